"""Running trained checkpoints: ``meshtron generate`` on one process or a tp x pp replica."""
