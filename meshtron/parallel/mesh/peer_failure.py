"""A collective that failed because another rank died or stalled, told apart from our own
errors, so that the command line can say it in one line instead of a gloo/NCCL traceback."""

from __future__ import annotations

import os
import traceback

import torch.distributed as dist

PEER_FAILURE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Socket closed",
                      "Broken pipe", "timed out", "Timed out", "Read timeout",
                      "pair closure", "NCCL communicator was aborted")
"""How gloo (tcp/pair.cc: a read or write on a pair whose peer is gone, or its timeout) and
NCCL word a collective that a dead or stalled peer broke."""
TRACEBACK_ENV = "MESHTRON_TRACEBACK"


def raised_by_torch_distributed(err: BaseException) -> bool:
    """The exception came out of a torch.distributed call (a collective, the store)."""
    marker = os.sep.join(("", "torch", "distributed", ""))
    frames = traceback.extract_tb(err.__traceback__)
    return any(marker in frame.filename for frame in frames)


def peer_failure(err: BaseException) -> str | None:
    """One line for a collective that failed because another rank died or stalled: a
    torch.distributed error, or a RuntimeError raised inside torch.distributed whose text
    names a lost connection or a timeout. Anything else keeps its traceback, as does this
    with MESHTRON_TRACEBACK=1."""
    if os.environ.get(TRACEBACK_ENV) == "1":
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    text = str(err)
    from_collective = isinstance(err, RuntimeError) and (  # a Work's wait() has no torch frame
        raised_by_torch_distributed(err) or "gloo" in text or "NCCL" in text)
    if isinstance(err, dist.DistError) or (
            from_collective and any(sign in text for sign in PEER_FAILURE_SIGNS)):
        first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        return (f"rank {dist.get_rank()} lost contact with the other ranks (a peer failed or "
                f"stalled beyond run.timeout_s; {TRACEBACK_ENV}=1 shows the traceback): "
                f"{first[-160:]}")
    return None
