"""Fixture for the test Kubernetes control plane (filled in by the control-plane work)."""
