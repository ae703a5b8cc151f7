"""Importers from outside model formats into canonical weights (numpy only, no framework)."""
