"""Framework-free core of Transformer Rosetta: the spec, the weight format, the NumPy oracle."""
