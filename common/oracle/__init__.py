"""The executable spec: the NumPy float64 forward pass, loss and Adam."""
