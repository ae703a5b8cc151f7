"""The Backend protocol every framework implements, its registry, and the oracle's own backend."""
