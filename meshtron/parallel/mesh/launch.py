"""``meshtron train --nproc N``: start N local ranks through PyTorch's elastic launcher.

The same agent as ``torchrun --standalone --nproc-per-node N -m meshtron train ...``: it sets
the rendezvous variables, watches the ranks, and stops the others when one fails. A failure is
reported as one line naming the rank (the rank's own error line is printed above it).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from meshtron.errors import MeshtronError


def launch_local(nproc: int, train_args: Sequence[str]) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args([  # what torchrun's --standalone means: a private rendezvous
        "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4()}",
        f"--nproc-per-node={nproc}", "--max-restarts=0",
        "--module", "meshtron", "train", *train_args,
    ])
    config, entrypoint, entry_args = torchrun.config_from_args(args)
    try:
        elastic_launch(config, entrypoint)(*entry_args)
    except ChildFailedError as err:
        rank, failure = min(err.failures.items())
        raise MeshtronError(
            f"rank {rank} exited with code {failure.exitcode}; the other ranks were stopped"
        ) from None
    return 0
