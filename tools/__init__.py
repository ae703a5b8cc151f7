"""Contributors' tools, run from a checkout (`python -m tools.docs`) and never installed: the
wheel holds `transformer_rosetta` alone (pyproject's packages list)."""
