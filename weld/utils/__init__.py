"""Helpers shared by every layer: stdlib and numpy only."""
