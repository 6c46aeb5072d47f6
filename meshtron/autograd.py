"""What the autograd engine is doing right now, for hooks that must behave differently inside
a backward pass (a forward recomputed by activation checkpointing runs inside one)."""

import torch


def in_backward() -> bool:
    """True while autograd executes a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1
