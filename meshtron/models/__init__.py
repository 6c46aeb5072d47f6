"""Model definitions: the decoder, presets, and size/FLOPs accounting."""
