"""Weights in from and out to outside formats (nn.Transformer, Marian) and between frameworks' native checkpoints."""
