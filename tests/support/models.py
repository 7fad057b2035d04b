"""Fixtures for the project's own models (filled in by the engine-core work)."""
