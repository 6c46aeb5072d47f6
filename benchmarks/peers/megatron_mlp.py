"""megatron-core's tensor-parallel MLP pattern, column -> row linear: the layer peer.

Importing this module imports megatron-core (about 5 s and 100 MB), so a benchmark imports it
only in the processes that use it, and only when it is installed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import layers
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")


def _config(tp: int, sequence_parallel: bool) -> ModelParallelConfig:
    """fp32, CPU initialisation, no initialisation of the weights (they are copied in)."""
    return ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                               perform_initialization=False, params_dtype=torch.float32,
                               sequence_parallel=sequence_parallel)


def _pair(hidden: int, ffn: int, config: ModelParallelConfig) -> tuple[Any, Any]:
    no_init = lambda _: None  # noqa: E731
    col = layers.ColumnParallelLinear(hidden, ffn, config=config, init_method=no_init,
                                      bias=False, gather_output=False)
    row = layers.RowParallelLinear(ffn, hidden, config=config, init_method=no_init, bias=False,
                                   input_is_parallel=True, skip_bias_add=False)
    return col, row


def mlp_pair(hidden: int, ffn: int, tp: int) -> tuple[Any, Any]:
    """``initialize_model_parallel`` (on the default gloo group), then
    ``ColumnParallelLinear(gather_output=False)`` and ``RowParallelLinear(input_is_parallel=
    True)``, no bias; called as ``row(col(x)[0])``, each returning (output, bias)."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return _pair(hidden, ffn, _config(tp, sequence_parallel=False))


def sequence_parallel_error(x: torch.Tensor, rank: int, tp: int, ffn: int) -> str | None:
    """Try the sequence-parallel pair (after :func:`mlp_pair`) on ``x`` [batch, seq, hidden];
    the error it stops with on this machine, if any."""
    config = _config(tp, sequence_parallel=True)
    try:
        col, row = _pair(x.shape[-1], ffn, config)
        for p in (*col.parameters(), *row.parameters()):
            torch.nn.init.normal_(p, std=0.02)
        inp = x.transpose(0, 1).chunk(tp, dim=0)[rank].contiguous().requires_grad_()
        y, _ = row(col(inp)[0])
        y.sum().backward()
    except Exception as err:  # noqa: BLE001 - this is the finding
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None
