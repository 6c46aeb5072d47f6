"""Cached decoding equals the model, as a property (issue 45 item 1, issue 46's two escaped
decode bugs).

For random small shapes (head counts that are not powers of two; GQA groups of 1, 3 and more;
head widths 64, 80 and 128; tied and untied embeddings; every rope scaling; sliding windows;
latent attention with its weight-absorbed decode; mixtures of experts; q/k norms; learned
positions) a fp64 model with random weights, scaled so its logits are far from flat, generates
64 greedy tokens for prompts of different lengths batched with left padding. The logits of
every step (the prefill's last position, then each one-token decode step) must equal those of
a full forward without a cache over that prompt alone followed by the tokens generated so far,
to 1e-5 relative, and every greedy token must be the full forward's argmax. Logits, not a few
tokens of a barely trained model, are the assertion: an argmax hides a position shifted by one
or a padded key attended to, a logit does not.

The one-process set runs every shape kind; the multi-process set (tp=3 x pp=2 and tp=2 x pp=3
in one group of 6 ranks) loads the one-process model's weights from a checkpoint, resharded,
and checks its logits against the one-process full forward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.model_io import write_model_checkpoint
from meshtron.checkpoint.train_state import load_weights
from meshtron.config import Config, load_config
from meshtron.models.generation import GREEDY, Generator
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.tensor.collectives import all_gather
from meshtron.plan import plan_generation
from meshtron.precision.policy import Precision
from tests.distributed import run_distributed


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these small products run 5-50x slower with two threads on a
    shared, loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


STEPS = 64
RTOL = 1e-5
KINDS = ("gqa", "linear", "llama3", "yarn", "window", "mla", "mla-yarn", "moe", "qk-norm",
         "gpt2")
"""What each drawn shape exercises beyond its random dimensions (seed % len(KINDS))."""
HEADS = ((3, 3), (6, 6), (6, 2), (9, 3), (12, 3), (6, 1), (9, 1), (5, 1), (12, 4), (10, 2))
"""(heads, kv heads): GQA groups of 1, 3, 4, 5, 6 and 9."""
ROPE = {"linear": ["--model.rope.scaling=linear", "--model.rope.factor=2"],
        "llama3": ["--model.rope.scaling=llama3", "--model.rope.factor=8",
                   "--model.rope.original_max_len=32"],
        "yarn": ["--model.rope.scaling=yarn", "--model.rope.factor=4",
                 "--model.rope.original_max_len=32"]}


@dataclass(frozen=True)
class Shape:
    """A drawn model and the prompts it decodes."""

    seed: int
    overrides: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]

    @property
    def name(self) -> str:
        return f"{KINDS[self.seed % len(KINDS)]}-{self.seed}"


def draw(seed: int, tp: int = 1, heads: tuple[int, int] | None = None) -> Shape:
    """A random shape of kind ``KINDS[seed % len(KINDS)]`` with (heads, kv heads) ``heads`` or
    drawn from :data:`HEADS`, its padded vocabulary a multiple of ``tp``."""
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    heads, kv = heads or rng.choice(HEADS)
    vocab = rng.randrange(100, 200)
    head_dim = rng.choice((64, 80, 128))
    hidden = heads * 8 if kind == "gpt2" else rng.choice((32, 48, 64))  # gpt2: hidden / heads
    own_width = kind == "gpt2" or kind.startswith("mla")  # widths from hidden or MLA's own
    model = [f"--model.num_heads={heads}", f"--model.num_kv_heads={kv}",
             f"--model.hidden_size={hidden}", *([] if own_width else
                                                [f"--model.head_dim={head_dim}"]),
             f"--model.vocab_size={vocab}", f"--model.vocab_multiple={16 * tp}",
             f"--model.tie_embeddings={rng.random() < 0.5}", "--model.ffn_hidden_size=48",
             "--model.num_layers=3", "--model.max_seq_len=96", "--model.norm_eps=1e-5",
             f"--model.rope_theta={rng.choice((1e4, 1e5))}", "--train.seq_len=16"]
    if kind in ROPE:
        model += ROPE[kind]
    elif kind == "window":
        model.append(f"--model.sliding_window={rng.choice((4, 7, 16))}")
    elif kind.startswith("mla"):
        q_rank = rng.choice((0, 24))
        model += ["--model.attention=mla", f"--model.num_kv_heads={heads}",
                  f"--model.q_lora_rank={q_rank}",
                  f"--model.kv_lora_rank={rng.choice((16, 32))}",
                  f"--model.qk_nope_head_dim={rng.choice((16, 32))}",
                  f"--model.qk_rope_head_dim={rng.choice((8, 16))}",
                  f"--model.v_head_dim={rng.choice((12, 32))}"]
        if kind == "mla-yarn":
            model += ROPE["yarn"] + ["--model.rope.mscale_all_dim=0.707"]
    elif kind == "moe":
        model += ["--model.moe.num_experts=4", "--model.moe.top_k=2",
                  "--model.moe.expert_ffn_size=24", f"--model.moe.shared_experts={seed % 2}",
                  f"--model.moe.score={rng.choice(('softmax', 'sigmoid'))}"]
    elif kind == "qk-norm":
        model += ["--model.qk_norm=true", "--model.qkv_bias=true"]
    elif kind == "gpt2":
        model += ["--model.arch=gpt2"]
    lengths = rng.sample(range(1, 13), 3)
    prompts = tuple(tuple(rng.randrange(1, vocab) for _ in range(n)) for n in lengths)
    return Shape(seed, tuple(model), prompts)


def config_of(shape: Shape, *extra: str) -> Config:
    return load_config(overrides=[*shape.overrides, *extra])


def reference_model(shape: Shape) -> Transformer:
    """The one-process fp64 model with random weights at a std that keeps logits apart (about
    1.5 / sqrt(hidden) per weight: unit-scale products, logits of std ~1.5), and every bias
    and norm weight moved off its initial 0 or 1 so that a dropped one shows."""
    cfg = config_of(shape).model
    model = Transformer(cfg)
    initialize(model, seed=shape.seed, std=1.5 / cfg.hidden_size ** 0.5,
               num_layers=cfg.num_layers)
    Precision("fp64", torch.device("cpu")).cast_parameters(model)
    gen = torch.Generator().manual_seed(shape.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.add_(0.2 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model.eval()


def decode(model: Transformer, mesh: ParallelMesh | None,
           prompts: tuple[tuple[int, ...], ...]) -> tuple[list[list[int]], torch.Tensor | None]:
    """Greedy tokens of the batched prompts and (on the last pipeline stage) the logits of
    every step [batch, steps, vocab], gathered over tp, as the generator sampled from them."""
    mesh = mesh or ParallelMesh.single()
    steps: list[torch.Tensor] = []

    def keep(module, args, out):
        steps.append(all_gather(out[:, -1], mesh.tp, dim=1)[:, : module.vocab_size])

    hook = model.register_forward_hook(keep) if model.has_head else None
    completions, _ = Generator(model, mesh).generate([list(p) for p in prompts], STEPS, GREEDY)
    if hook is not None:
        hook.remove()
    return [c.tokens for c in completions], torch.stack(steps, dim=1) if steps else None


@torch.no_grad()
def assert_decode_equals_full_forward(reference: Transformer, shape: Shape,
                                      tokens: list[list[int]], logits: torch.Tensor,
                                      what: str) -> None:
    """Each sequence's step logits against one full forward (no cache) over its prompt alone
    and its generated tokens; each greedy token against that forward's argmax."""
    for i, (prompt, new) in enumerate(zip(shape.prompts, tokens)):
        assert len(new) == STEPS, f"{what}: sequence {i} stopped after {len(new)} tokens"
        full = reference(torch.tensor([list(prompt) + new[:-1]]))
        expected = full[0, len(prompt) - 1:, : reference.vocab_size]
        spread = expected.std(dim=-1).min().item()
        assert spread > 0.3, f"{what}: logits nearly flat (std {spread:.3f}), nothing is tested"
        error = ((logits[i] - expected).abs().amax(-1) / expected.abs().amax(-1))
        worst = int(error.argmax())
        assert error[worst] <= RTOL, (
            f"{what}: sequence {i} (prompt of {len(prompt)}) step {worst}: decode logits differ "
            f"from the full forward by {error[worst]:.2e} relative")
        greedy = expected.argmax(-1).tolist()
        assert new == greedy, f"{what}: sequence {i} greedy tokens differ from the full forward"


FAST = list(range(len(KINDS)))
"""One shape of each kind."""
SLOW = list(range(len(KINDS), 3 * len(KINDS)))
"""Two more of each kind."""


def check_one_process(seed: int) -> None:
    shape = draw(seed)
    model = reference_model(shape)
    tokens, logits = decode(model, None, shape.prompts)
    assert_decode_equals_full_forward(model, shape, tokens, logits, shape.name)


@pytest.mark.parametrize("seed", FAST, ids=[draw(s).name for s in FAST])
def test_cached_decode_equals_the_full_forward(seed):
    check_one_process(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW, ids=[draw(s).name for s in SLOW])
def test_cached_decode_equals_the_full_forward_on_more_shapes(seed):
    check_one_process(seed)


PARALLEL = {(3, 2): ((0, (9, 3)), (5, (6, 6)), (7, (6, 1))),
            (2, 3): ((3, (6, 1)), (6, (10, 10)), (4, (6, 2)))}
"""(tp, pp) on 6 ranks (pp=3: one layer per stage) and its (seed, (heads, kv heads)): at tp=3
SmolLM2's 9 heads / 3 kv heads, latent attention and a MoE with one kv head shared by the three
ranks; at tp=2 yarn with one shared kv head, latent attention with yarn, a sliding window."""


def parallel_shapes() -> list[tuple[int, int, Shape]]:
    return [(tp, pp, draw(seed, tp, heads)) for (tp, pp), cases in PARALLEL.items()
            for seed, heads in cases]


def parallel_decode(rank: int, world_size: int, paths: list[str]) -> list:
    """Worker body: every layout's shapes, loaded from the one-process checkpoints."""
    out = []
    for (tp, pp, shape), path in zip(parallel_shapes(), paths):
        cfg = config_of(shape, f"--parallel.tp={tp}", f"--parallel.pp={pp}")
        plan = plan_generation(cfg, tp * pp)
        mesh = ParallelMesh(MeshLayout(world_size, tp=tp, pp=pp), rank)
        # a rank that only generates (no optimizer), its weights loaded in fp64
        model = Transformer(plan.model, mesh, plan.model_options(mesh.pp.rank))
        Precision("fp64", torch.device("cpu")).cast_parameters(model)
        load_weights(Path(path), model)
        out.append(decode(model.eval(), mesh, shape.prompts))
    return out


@pytest.mark.slow
def test_cached_decode_equals_the_full_forward_at_tp_and_pp(tmp_path):
    references, paths = [], []
    for tp, _, shape in parallel_shapes():
        model = reference_model(shape)
        tensors = {name: p.detach() for name, p in model.named_parameters()}
        references.append(model)
        paths.append(str(write_model_checkpoint(tmp_path / f"{shape.name}-tp{tp}",
                                                config_of(shape), tensors)))
    results = run_distributed(parallel_decode, 6, paths)
    for i, (tp, pp, shape) in enumerate(parallel_shapes()):
        tokens, logits = results[-1][i]  # the last rank: the last stage's last tp rank
        for rank, result in enumerate(results):
            assert result[i][0] == tokens, f"{shape.name}: rank {rank} generated other tokens"
        assert_decode_equals_full_forward(references[i], shape, tokens, logits,
                                          f"{shape.name} at tp={tp} pp={pp}")


GEMMA3 = ("--model.arch=gemma3", "--model.qk_norm=true", "--model.sliding_window=5",
          "--model.sliding_window_pattern=3", "--model.rope_local_theta=10000",
          "--model.query_pre_attn_scalar=24", "--model.logit_softcap=30")
"""Gemma 3's parts on a drawn shape: windowed layers with their own rotary base between
global ones, q/k norms, the query scalar, scaled embeddings, post norms, soft-capped logits."""


@pytest.mark.parametrize("seed", [0, 3])
def test_cached_decode_equals_the_full_forward_for_gemma3(seed):
    drawn = draw(seed)
    shape = Shape(drawn.seed, (*drawn.overrides, *GEMMA3), drawn.prompts)
    model = reference_model(shape)
    tokens, logits = decode(model, None, shape.prompts)
    assert_decode_equals_full_forward(model, shape, tokens, logits, f"gemma3-{seed}")
