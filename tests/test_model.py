"""The decoder against Hugging Face `transformers` twins, and its size/FLOPs accounting."""

import pytest
import torch

from meshtron.checkpoint.hf_mapping import from_hf, hf_config_kwargs, to_hf
from meshtron.config import load_config
from meshtron.models.flops import model_size, training_flops_per_token
from meshtron.models.generation import filter_logits, generate
from meshtron.models.init import initialize
from meshtron.models.transformer import WHOLE_MODEL, ModelOptions, Transformer


def build(*overrides, seed=3, options=WHOLE_MODEL):
    cfg = load_config(overrides=["--model.vocab_size=300", "--model.hidden_size=64",
                                 "--model.num_heads=4", "--model.ffn_hidden_size=96",
                                 "--model.num_layers=2", *overrides]).model
    model = Transformer(cfg, options=options)
    initialize(model, seed=seed, std=0.02, num_layers=cfg.num_layers)
    return cfg, model


def hf_twin(cfg, model):
    transformers = pytest.importorskip("transformers")  # only the twin tests need it
    if cfg.arch == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_kwargs(cfg)))
    else:
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config_kwargs(cfg)))
    state = to_hf({k: v.detach() for k, v in model.state_dict().items()}, cfg)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected
    assert all("attn.bias" in k or "masked_bias" in k for k in missing), missing
    return hf.eval()


@pytest.mark.parametrize(
    "overrides",
    [
        ("--model.num_kv_heads=4",),
        ("--model.num_kv_heads=2", "--model.tie_embeddings=true"),
        ("--model.num_kv_heads=1", "--model.rope_theta=500000"),
        ("--model.arch=gpt2", "--model.tie_embeddings=true"),
        ("--model.arch=gpt2",),
    ],
)
def test_logits_equal_transformers(overrides):
    cfg, model = build(*overrides)
    hf = hf_twin(cfg, model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 37))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    assert ours.shape == (2, 37, 384)  # 300 padded to a multiple of 128
    assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_mapping_round_trips(arch):
    cfg, model = build(f"--model.arch={arch}")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    back = from_hf(to_hf(state, cfg), cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_the_model(arch, tied):
    cfg, model = build(f"--model.arch={arch}", f"--model.tie_embeddings={tied}")
    assert model_size(cfg).params == sum(p.numel() for p in model.parameters())


def test_published_shapes_have_their_published_sizes():
    def billions(preset):
        cfg = load_config(overrides=[f"--model.preset={preset}"]).model
        return model_size(cfg).params / 1e9

    assert billions("llama3-8b") == pytest.approx(8.03, abs=0.01)
    assert billions("llama3-70b") == pytest.approx(70.55, abs=0.05)
    assert billions("llama3-405b") == pytest.approx(405.9, abs=0.5)
    assert billions("gpt3-175b") == pytest.approx(174.6, abs=0.5)
    assert billions("gpt2-small") == pytest.approx(0.124, abs=0.001)
    assert billions("small") == pytest.approx(0.134, abs=0.002)


def test_flops_per_token_formula():
    """Llama-3-8B written out by hand: 32 layers, h = 4096, 8 kv heads of 128, SwiGLU of
    14336, 128256 tokens. Each matmul weight costs 6 FLOPs per token (forward 2, backward 4;
    the embedding lookup is not a matmul, the output head is), attention's two s x s
    products 3 x 2 x 2 x s x h per layer."""
    cfg = load_config(overrides=["--model.preset=llama3-8b"]).model
    layers, h, kv, ffn, vocab, seq = 32, 4096, 8 * 128, 14336, 128256, 8192
    per_layer = h * h + h * 2 * kv + h * h + 3 * h * ffn
    weights = layers * per_layer + h * vocab
    flops = training_flops_per_token(cfg, seq)
    assert flops == 6 * weights + 12 * layers * seq * h
    assert model_size(cfg).matmul_params == weights
    assert flops / 1e9 == pytest.approx(6 * 7.5 + 12.9, rel=0.02)


def test_kv_cache_decoding_equals_full_forward():
    cfg, model = build("--model.num_kv_heads=2")
    tokens = torch.randint(0, cfg.vocab_size, (2, 30))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, 30)
        parts = [model(tokens[:, :17], cache), model(tokens[:, 17:25], cache)]
        parts += [model(tokens[:, i : i + 1], cache) for i in range(25, 30)]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_identical_gradients(mode):
    _, ref = build()
    _, other = build(options=ModelOptions(recompute=mode))
    tokens = torch.randint(0, 300, (2, 17))
    grads = []
    for model in (ref, other):
        model.loss_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)


def test_padded_vocabulary_never_counts_in_the_loss():
    _, model = build()
    logits = torch.randn(2, 5, 384, requires_grad=True)
    targets = torch.randint(0, 300, (2, 5))
    boosted = logits.detach().clone()
    boosted[..., 300:] = 1e4  # huge logits on padding rows change nothing
    loss = model.loss_sum(logits, targets)
    assert torch.equal(loss, model.loss_sum(boosted, targets))
    expected = torch.nn.functional.cross_entropy(logits[..., :300].reshape(-1, 300),
                                                 targets.reshape(-1), reduction="sum")
    assert torch.allclose(loss, expected)
    loss.backward()
    assert logits.grad[..., 300:].abs().max() == 0


def test_init_is_a_function_of_seed_and_name_only():
    _, a = build(seed=5)
    _, b = build(seed=5)
    _, c = build(seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc)


def test_sampling_filters_and_greedy_decoding():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert torch.isinf(filter_logits(logits, 2, 1.0)[:2]).all()
    kept = filter_logits(logits, 0, 0.5)  # p(3)=0.64 alone covers 0.5
    assert torch.isfinite(kept).tolist() == [False, False, False, True]
    cfg, model = build()
    greedy = generate(model, [1, 2, 3], 6, temperature=0)
    assert greedy == generate(model, [1, 2, 3], 6, temperature=0)
    with torch.no_grad():
        seq = torch.tensor([[1, 2, 3] + greedy[:-1]])
        expected = model(seq)[0, 2:, :300].argmax(-1).tolist()
    assert greedy == expected
    sampled = generate(model, [1], 10, temperature=1.0, top_k=5, seed=1)
    assert len(sampled) == 10 and all(0 <= t < 300 for t in sampled)
