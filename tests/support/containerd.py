"""Fixture module (filled in by its owner)."""
