"""The shared safetensors weight format and deterministic initialisation."""
