"""The Transformer in Flax NNX (nnx.Module) on JAX."""
