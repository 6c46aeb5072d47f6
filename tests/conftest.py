"""Shared fixtures: a tiny model config and a data cache built once per test session."""

from __future__ import annotations

import pytest

from tests.parity import test_overrides, warm_data_cache


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """A cache dir holding the tokenizer and dataset of the test corpus, built once."""
    cache = str(tmp_path_factory.mktemp("meshtron-cache"))
    warm_data_cache(cache)
    return cache


@pytest.fixture
def tiny_overrides(data_cache, tmp_path) -> list[str]:
    """Overrides for a tiny, fast run in a fresh run directory."""
    return test_overrides(data_cache, str(tmp_path / "run"))


@pytest.fixture(scope="session")
def smollm_checkpoint(tmp_path_factory):
    """The real SmolLM2-135M imported from its GGUF file once per session (tests/real_model.py)."""
    from tests.real_model import import_smollm

    return import_smollm(tmp_path_factory.mktemp("smollm") / "imported")


@pytest.fixture(scope="session")
def smollm_transformers():
    """transformers' reading of the same GGUF file: (model, tokenizer), once per session."""
    from tests.real_model import load_transformers_model

    return load_transformers_model()
