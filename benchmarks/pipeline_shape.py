"""The model ``benchmarks/pipeline.py`` trains and ``benchmarks/pipeline_bound.py`` prices part
by part: one shape, so both measure the same pipeline (apart from either script)."""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config import Config, load_config


@dataclass(frozen=True)
class Shape:
    """The model (``tiny``'s llama at these sizes) and the batch: every configuration's."""

    layers: int = 8
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 768
    vocab: int = 4096
    seq: int = 128
    global_batch: int = 16
    micro_batch: int = 2

    @property
    def microbatches(self) -> int:
        return self.global_batch // self.micro_batch

    def config(self, *extra: str) -> Config:
        return load_config(overrides=[
            "--model.preset=tiny", f"--model.num_layers={self.layers}",
            f"--model.hidden_size={self.hidden}", f"--model.num_heads={self.heads}",
            f"--model.num_kv_heads={self.kv_heads}", f"--model.ffn_hidden_size={self.ffn}",
            f"--model.vocab_size={self.vocab}", f"--train.seq_len={self.seq}",
            f"--train.global_batch={self.global_batch}", f"--train.micro_batch={self.micro_batch}",
            *extra,
        ])

