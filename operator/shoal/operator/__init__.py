"""Shoal's Kubernetes operator (kopf). Must import without torch."""
