# Set-up and the two commands README.md opens with. Everything installs into ./.venv.
PYTHON ?= python3
# torch is installed first and pinned: a CPU build where the package index has one ready, and it
# keeps pip from pulling the newest (multi-GB CUDA) build as a dependency. Override for GPU machines,
# e.g. `make demo TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'`.
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-unit test-long lint gpu-check

$(BIN)/osft-train: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH_SPEC)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

setup: $(BIN)/osft-train

## The main job: fetch the demo model and data, fine-tune SmolLM2-135M-Instruct with OSFT on CPU.
demo: setup
	$(BIN)/osft-train demo --output-dir runs/demo --overwrite-output-dir

## The test suite (CI runs exactly this through .ci/run); tiers and the time budget: tests/README.md.
## Two pytest-xdist workers, a test file each at a time (module fixtures stay shared within a file):
## one process alone keeps about one of two cores busy. TEST_WORKERS=0 runs in one process. The files
## go to the workers in tests/conftest.py's order, the costliest first (--no-loadscope-reorder keeps it).
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

## The inner loop: tests that start no process (no torchrun, tmux, reader, benchmark, demo model).
UNIT_TIER := not long and not demo and not bench and not torchrun and not tui_process and not subprocess
test-unit: setup
	OSFT_TEST_TIER=unit $(BIN)/python -m pytest -q -m '$(UNIT_TIER)'

## ruff with the rules of pyproject.toml's [tool.ruff.lint]; .ci/run runs it before `make test`.
lint: setup
	$(BIN)/ruff check .

## Acceptance checks that take several minutes each (not in CI).
test-long: setup
	$(BIN)/python -m pytest -q -m long

## One prepared check for a CUDA machine (no set-up, no download; about 5 minutes): bf16 OSFT, a
## SIGUSR1 checkpoint and a bit-exact resume, tokens/s, MFU and peak GPU memory against full
## fine-tuning; results/gpu_check.json. Uses the python on PATH when there is no .venv (the
## machine's own PyTorch). Without CUDA it runs the tiny CPU smoke version.
GPU_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py
