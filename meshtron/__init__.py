"""meshtron: Megatron-class transformer training, every parallelism on one mesh, tested on CPU."""

__version__ = "0.1.0"
