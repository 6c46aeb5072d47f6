"""One point of the layout search: how a run is split and how it trades memory for time.

A candidate is the part of a run's config the tuner chooses; everything else (the model, the
batch, the precision) is fixed by the user. ``dp`` follows from the world size, and ``etp``
is ``None`` (experts split over tp like the MLP) or 1 (whole experts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PARALLEL_PINS = ("tp", "cp", "pp", "vpp", "schedule", "ep", "etp", "zero", "sp")
"""The ``parallel.*`` config fields a user may pin; ``train.micro_batch`` and
``train.recompute`` pin the other two."""


@dataclass(frozen=True)
class Candidate:
    tp: int
    cp: int
    pp: int
    vpp: int
    schedule: str
    ep: int
    etp: int | None
    dp: int
    zero: int
    sp: bool
    micro_batch: int
    recompute: str

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def vshape(self) -> bool:
        """Chunks placed in a V (zb-v): another partition than looped chunks of the same vpp."""
        return self.schedule == "zb-v"

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return global_batch // (self.dp * self.micro_batch)

    def overrides(self) -> dict[str, object]:
        """The config fields that run this candidate, as ``section.field`` keys."""
        parallel = {f"parallel.{k}": v for k, v in asdict(self).items()
                    if k in PARALLEL_PINS and not (k == "etp" and v is None)}
        return {**parallel, "train.micro_batch": self.micro_batch,
                "train.recompute": self.recompute}

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"cp{self.cp}", f"pp{self.pp}"]
        if self.pp > 1:
            parts.append(self.schedule + (f"x{self.vpp}" if self.vpp > 1 else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + ("/etp1" if self.etp == 1 else ""))
        parts += [f"dp{self.dp}", f"zero{self.zero}"] + (["sp"] if self.sp else [])
        return " ".join(parts + [f"mb{self.micro_batch}", self.recompute])


@dataclass(frozen=True)
class Pins:
    """Fields the user fixed; None leaves a field to the search."""

    tp: int | None = None
    cp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    schedule: str | None = None
    ep: int | None = None
    etp: int | None = None
    zero: int | None = None
    sp: bool | None = None
    micro_batch: int | None = None
    recompute: str | None = None

    def allow(self, name: str, options: list) -> list:
        pinned = getattr(self, name)
        return [pinned] if pinned is not None else options
