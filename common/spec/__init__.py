"""The specification: config and presets, canonical names and shapes, masks, dtypes, tolerances, id checks, result types."""
