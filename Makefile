# `make train` and `make test` do all the set-up: they create .venv and install the project when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=
NPROC ?= 2

.DEFAULT_GOAL := help
.PHONY: help install train ddp sweep shards bench bench-quick test test-slow test-gpu test-all lint format clean

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  Pass overrides with ARGS, e.g. make train ARGS='data.num_workers=2 train.epochs=1'"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP) ## Create .venv (if missing) and install the project with its dev tools

train: $(STAMP) ## Train a ResNet on the default `shapes` dataset (generated locally, no download)
	$(BIN)/python train.py $(ARGS)

ddp: $(STAMP) ## Train with DDP: NPROC (default 2) processes via torchrun; gloo on CPU, nccl on GPUs
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) train.py $(ARGS)

sweep: $(STAMP) ## Sweep data.num_workers (0,1,2) for a fixed step budget; ends with sweep_summary.{csv,md,png}
	$(BIN)/python train.py -m data.num_workers=0,1,2 train.max_steps=150 $(ARGS)

shards: $(STAMP) ## Pack an image folder into shards: make shards SRC=<image folder> DST=<directory or s3://bucket/prefix>
	@test -n "$(SRC)" -a -n "$(DST)" || { echo "usage: make shards SRC=<image folder> DST=<directory or s3://bucket/prefix> [ARGS='--shard-mb 64']"; exit 2; }
	$(BIN)/imgtrain-shards "$(SRC)" "$(DST)" $(ARGS)

bench: $(STAMP) ## The benchmark harness (~40 min on 2 CPUs; the checkpoint section is 16, breakdown 10): JSON in benchmarks/results/, report appended to BENCHMARKS.md
	$(BIN)/python benchmarks/bench.py $(ARGS)

bench-quick: $(STAMP) ## The harness's smoke test: every path, few steps, report to a temporary directory
	$(BIN)/python benchmarks/bench.py --quick --workdir $$(mktemp -d) --json /tmp/imgtrain-bench-quick.json --markdown /tmp/imgtrain-bench-quick.md

test: $(STAMP) ## Run the fast test suite (under 5 minutes on 2 cores; slow tests: make test-slow or make test-all)
	$(BIN)/python -m pytest --durations=15 $(PYTEST_ARGS)

test-slow: $(STAMP) ## Run only the slow tests (what CI runs after make test)
	$(BIN)/python -m pytest -m slow --durations=15 $(PYTEST_ARGS)

test-gpu: $(STAMP) ## Run the CUDA tests (tests/test_gpu.py) on this machine's GPU; they skip without one
	$(BIN)/python -m pytest -m gpu -rs $(PYTEST_ARGS)

test-all: $(STAMP) ## Run every test, the slow ones included
	$(BIN)/python -m pytest -m "" $(PYTEST_ARGS)

lint: $(STAMP) ## ruff check and format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP) ## Apply ruff's fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean: ## Remove outputs and caches (keeps .venv and the generated datasets)
	rm -rf outputs .pytest_cache .ruff_cache
