# `make train` and `make test` do all the set-up: they create .venv and install the project when needed.
# NOVENV=1 installs nothing and runs PYTHON as it is, with src/ on PYTHONPATH: a machine without a package index
# whose interpreter already has the packages, e.g. `make test-gpu NOVENV=1 PYTHON=python3` on the GPU box.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=
# make test's and make test-slow's processes (pytest-xdist; tests/conftest.py gives each its share of the CPUs): 2 fit
# CI's 2 cores
TEST_WORKERS ?= 2
NPROC ?= 2
# make gpu-check: where its results go (on the GPU box: GPU_CHECK_OUT=$$OUT) and the commit the tree is (the box gets
# the tree without .git)
GPU_CHECK_OUT ?= outputs/gpu-check
GPU_CHECK_COMMIT ?=
# The tests start some 40 Python processes (train.py, torchrun's ranks, pytest's workers): with bytecode caches
# (gitignored __pycache__/) each imports imgtrain without compiling it again, where an environment that sets
# PYTHONDONTWRITEBYTECODE=1 made every process compile it (pytest's collection: 9.4 s, 6.7 s with the caches, on 2
# cores, 2026-11-27)
unexport PYTHONDONTWRITEBYTECODE
ifdef NOVENV
SETUP :=
RUN := PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON)
else
SETUP := $(STAMP)
RUN := $(BIN)/python
endif

.DEFAULT_GOAL := help
.PHONY: help install train ddp sweep shards bench bench-quick bench-gpu gpu-check test test-slow test-gpu test-all lint format docs clean

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  Pass overrides with ARGS, e.g. make train ARGS='data.num_workers=2 train.epochs=1'"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e ".[shards,search,threads,timm,gpu-decode,dev]"
	@touch $(STAMP)

install: $(STAMP) ## Create .venv (if missing) and install the project with every optional engine and its dev tools

train: $(SETUP) ## Train a ResNet on the default `shapes` dataset (generated locally, no download)
	$(RUN) train.py $(ARGS)

ddp: $(SETUP) ## Train with DDP: NPROC (default 2) processes via torchrun; gloo on CPU, nccl on GPUs
	$(RUN) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) train.py $(ARGS)

sweep: $(SETUP) ## Sweep data.num_workers (0,1,2) for a fixed step budget; ends with sweep_summary.{csv,md,png}
	$(RUN) train.py -m data.num_workers=0,1,2 train.max_steps=150 $(ARGS)

shards: $(SETUP) ## Pack an image folder into shards: make shards SRC=<image folder> DST=<directory or s3://bucket/prefix>
	@test -n "$(SRC)" -a -n "$(DST)" || { echo "usage: make shards SRC=<image folder> DST=<directory or s3://bucket/prefix> [ARGS='--shard-mb 64']"; exit 2; }
	$(RUN) -m imgtrain.data.shards.command "$(SRC)" "$(DST)" $(ARGS)

bench: $(SETUP) ## The benchmark harness (~80 min on 2 CPUs; the checkpoint section is 16, augment-loaders 15, breakdown 10, big-photos 10, per-core 8 with valgrind): JSON in benchmarks/results/, report appended to BENCHMARKS.md
	$(RUN) benchmarks/bench.py $(ARGS)

bench-quick: $(SETUP) ## The harness's smoke test: every path, few steps, report to a temporary directory
	$(RUN) benchmarks/bench.py --quick --workdir $$(mktemp -d) --json /tmp/imgtrain-bench-quick.json --markdown /tmp/imgtrain-bench-quick.md

bench-gpu: $(SETUP) ## The GPU sections of the harness (gpu-ceilings, gpu-jpeg, recipe-cost; ~15 min on one H100); timm's side: ARGS='--timm-train PATH'
	$(RUN) benchmarks/bench.py --only gpu-ceilings,gpu-jpeg,recipe-cost $(ARGS)

gpu-check: $(SETUP) ## GPU tests and every headline GPU figure in one call of at most 5 min on one H200, results as they come in GPU_CHECK_OUT (docs/gpu.md)
	$(RUN) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) $(if $(GPU_CHECK_COMMIT),--commit "$(GPU_CHECK_COMMIT)") $(ARGS)

test: $(SETUP) ## Run the fast test suite in TEST_WORKERS processes (2 min on 2 cores; slow tests: make test-slow)
	$(RUN) -m pytest -n $(TEST_WORKERS) --durations=15 $(PYTEST_ARGS)

test-slow: $(SETUP) ## Run only the slow tests in TEST_WORKERS processes (15 min on 2 cores; what CI runs after make test)
	$(RUN) -m pytest -m slow -n $(TEST_WORKERS) --durations=15 $(PYTEST_ARGS)

test-gpu: $(SETUP) ## Run the CUDA tests on this machine's GPU (they skip without one); NOVENV=1 PYTHON=python3 where there is no index
	$(RUN) -m pytest -m gpu -rs $(PYTEST_ARGS)

test-all: $(SETUP) ## Run every test, the slow ones included
	$(RUN) -m pytest -m "" $(PYTEST_ARGS)

lint: $(SETUP) ## ruff check and format check
	$(RUN) -m ruff check .
	$(RUN) -m ruff format --check .

format: $(SETUP) ## Apply ruff's fixes and formatting
	$(RUN) -m ruff check --fix .
	$(RUN) -m ruff format .

docs: $(SETUP) ## Write docs/configuration-reference.md from the config schemas (tests/test_docs.py checks it)
	$(RUN) -m imgtrain.config.reference

clean: ## Remove outputs and caches (keeps .venv and the generated datasets)
	rm -rf outputs .pytest_cache .ruff_cache
