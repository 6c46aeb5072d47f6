"""Checkpoints: crash-safe directories of safetensors files, resume, loading for inference."""
