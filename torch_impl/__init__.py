"""The Transformer in PyTorch (nn.Module)."""
