# Two commands on a fresh clone: `make demo` and `make test`. Each creates .venv when needed.
# torch is installed first and pinned: on these machines torch==2.13.0 is a CPU build on disk;
# GPU users override it, e.g. `make test TORCH_SPEC="torch==2.13.0 --index-url <their index>"`.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
PYTEST_ARGS ?=
TORTURE_TRIALS ?= 200

.PHONY: demo demo-async test lint torture bench scale gpu-check venv clean distclean

venv: $(STAMP)

# What the demo needs: the torch pin, the package and its demo extra; nothing compiled.
$(DEMO_STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[demo]"
	touch $(DEMO_STAMP)

# What the suite and lint need besides: test tools, DeepSpeed and its CPU ops (built once).
$(STAMP): $(DEMO_STAMP)
	$(BIN)/python -m pip install --quiet -e ".[test,demo,deepspeed,lint]"
	cd tests && ../$(BIN)/python build_ops.py
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/areal-ckpt launch --config configs/demo.yaml -- $(BIN)/python -m areal_ckpt.demo.train --config configs/demo.yaml

# Asynchronous GRPO: a rollout thread ahead of the trainer, killed at a random instant, resumed
# with its prompts in flight (the rollout frontier); reports each prompt trained once per epoch.
demo-async: $(DEMO_STAMP)
	$(BIN)/areal-ckpt launch --config configs/demo-async.yaml -- $(BIN)/python -m areal_ckpt.demo.async_grpo --config configs/demo-async.yaml

# Debian packages some tests need: fuse3 (the power-loss tests serve a FUSE file system,
# tests/crashfs.py) and libaio-dev (DeepSpeed's NVMe offload, refused by name in a test)
SYSTEM := /usr/bin/fusermount3 /usr/include/libaio.h
PACKAGES := fuse3 libaio-dev

$(SYSTEM):
	apt-get install -y -q $(PACKAGES) >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q $(PACKAGES) >/dev/null)

# Azurite, the Azure Blob emulator the az:// tests start on 127.0.0.1 (npm; node is on the machine)
AZURITE := $(VENV)/azurite/node_modules/.bin/azurite-blob

$(AZURITE): | $(STAMP)
	npm install --silent --prefix $(VENV)/azurite azurite@3.37.0 --no-audit --no-fund

# The suite runs in two pytest workers (many tests wait on subprocesses and servers);
# PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 2

test: $(SYSTEM) $(STAMP) $(AZURITE)  # system packages first: the environment's op build needs libaio
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# ruff (lint rules and formatting) on the code, tests and benchmarks; mypy --strict on the package
lint: $(STAMP)
	$(BIN)/ruff check areal_ckpt tests benchmarks
	$(BIN)/ruff format --check areal_ckpt tests benchmarks
	$(BIN)/mypy

torture: $(STAMP)
	cd tests && ../$(BIN)/python torture.py --trials $(TORTURE_TRIALS) --out ../runs/torture-results.md

bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py --out docs/benchmarks.md
	$(BIN)/python benchmarks/bench_async.py --out docs/benchmarks-async.md
	$(BIN)/python benchmarks/bench_multirank.py --out docs/benchmarks-multirank.md
	cd benchmarks && ../$(BIN)/python bench_deepspeed.py --out ../docs/benchmarks-deepspeed.md
	cd benchmarks && ../$(BIN)/python bench_reshard.py --out ../docs/benchmarks-reshard.md
	$(BIN)/python benchmarks/bench_lora.py --out docs/benchmarks-lora.md
	cd benchmarks && ../$(BIN)/python bench_dump.py --out ../docs/benchmarks-dump.md
	cd benchmarks && ../$(BIN)/python bench_objects.py --out ../docs/benchmarks-objects.md
	cd benchmarks && ../$(BIN)/python bench_tiered.py --out ../docs/benchmarks-tiered.md
	cd benchmarks && ../$(BIN)/python bench_peer_copies.py --out ../docs/benchmarks-peer-copies.md
	cd benchmarks && ../$(BIN)/python bench_cli.py --out ../docs/benchmarks-cli.md
	cd benchmarks && ../$(BIN)/python bench_preemption.py --out ../docs/benchmarks-preemption.md
	cd benchmarks && ../$(BIN)/python bench_frontier.py --out ../docs/benchmarks-frontier.md
	cd benchmarks && ../$(BIN)/python bench_diff.py --out ../docs/benchmarks-diff.md

# the paths only a GPU takes, once, one line per check (docs/benchmarks-gpu.md); exits 2 without CUDA.
# Install a CUDA build of torch: `make gpu-check TORCH_SPEC="torch==2.13.0 --index-url <a CUDA index>"`
gpu-check: $(DEMO_STAMP)  # torch, the package and transformers: no DeepSpeed build
	cd benchmarks && ../$(BIN)/python gpu_check.py --out ../docs/benchmarks-gpu.md

# the full elastic matrix (1 <-> 4 ranks, real processes) and the per-rank cost of a dump at 1-4 ranks
scale: $(STAMP)
	$(BIN)/python -m pytest -m scale -n 2 tests/test_scale.py
	cd benchmarks && ../$(BIN)/python bench_scale.py --out ../docs/scale.md

# `make clean` starts the demo over (its runs/ folder) and keeps the environment; `make
# distclean` removes the environment too.
clean:
	rm -rf runs .pytest_cache

distclean: clean
	rm -rf $(VENV)
