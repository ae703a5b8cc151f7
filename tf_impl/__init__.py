"""The Transformer in Keras 3 (keras.layers.Layer, keras.ops), shipped on TensorFlow."""
