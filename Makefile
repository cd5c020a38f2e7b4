# disagg_rs development: every target CI and the README use. `make help` lists them.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-installed
DEV_STAMP := $(VENV)/.dev-deps-installed
# Hypothesis profile: "ci" (>= 200 examples per property) unless overridden.
export DISAGG_HYPOTHESIS_PROFILE ?= ci

.PHONY: help
help: ## Show the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2}'

# Set-up prints each step before it runs; pip and cargo show their own progress (no -q).
# Two stamps: what building and running need (requirements.txt: `make demo` stops there), and
# the test, lint and release tools on top (requirements-dev.txt: `make test`, `make lint`).
$(STAMP): requirements.txt requirements-nodeps.txt
	@echo "==> [1/3] Python virtual environment in $(VENV)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@echo "==> [2/3] Pinned dependencies (requirements.txt). A first run downloads about 3 GB"
	@echo "    (torch 2.11.0 with its CUDA 13 libraries, even on CPU-only machines) and takes"
	@echo "    a few minutes (5 for the whole first make demo on a busy 2-core machine); .venv"
	@echo "    ends up about 4.9 GB."
	@echo "    Later runs skip this step."
	$(PY) -m pip install --progress-bar on -r requirements.txt
	$(PY) -m pip install --progress-bar on --no-deps -r requirements-nodeps.txt
	@touch $@

$(DEV_STAMP): $(STAMP) requirements-dev.txt
	@echo "==> Test, lint and release tools (requirements-dev.txt: pytest, hypothesis, mypy, ruff,"
	@echo "    atheris, ziglang; about 90 MB to download, 0.6 GB installed)"
	$(PY) -m pip install --progress-bar on -r requirements-dev.txt
	@touch $@

.PHONY: venv
venv: $(DEV_STAMP) ## Create .venv with every pinned dependency (run, test, lint, release)

# `--skip-install` after the first install: maturin would otherwise re-run pip on the optional
# dependencies and print one "Ignoring ...: markers 'extra == ...'" line per extra.
.PHONY: build
build: $(STAMP) ## Build the Rust extension into .venv (release, overflow checks on)
	@echo "==> [3/3] Rust extension (cargo, release; the first build takes 2-9 minutes)"
	@if [ -f $(VENV)/bin/disagg-rs ]; then \
		$(PY) -m maturin develop --release --skip-install; \
	else \
		$(PY) -m maturin develop --release 2>&1 | { grep -v "^Ignoring " || true; }; \
	fi

.PHONY: test
test: $(DEV_STAMP) build wheel lint ## Build (extension and wheel), lint, then cargo test and the whole pytest suite
	cargo test --workspace --release -q
	$(PY) -m pytest -q

.PHONY: lint
lint: $(DEV_STAMP) ## cargo fmt/clippy, ruff, mypy and stubtest
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --release -q -- -D warnings
	$(PY) -m ruff check python tests benches
	$(PY) -m ruff format --check python tests benches
	$(PY) -m mypy
	$(PY) -m mypy.stubtest disagg_rs._core --allowlist .stubtest-allowlist

.PHONY: fmt
fmt: $(DEV_STAMP) ## Format Rust and Python sources
	cargo fmt --all
	$(PY) -m ruff format python tests benches
	$(PY) -m ruff check --fix python tests benches

WHEEL_DIR := dist
.PHONY: wheel
wheel: $(DEV_STAMP) ## Build the release wheel into dist/: abi3, manylinux_2_28 (zig linker), stripped
	rm -f $(WHEEL_DIR)/disagg_rs-*.whl
	@echo "==> Release wheel (zig linker, own target dir target/wheel; first build 2-4 minutes)"
	PATH="$(abspath $(VENV))/bin:$$PATH" CARGO_TARGET_DIR=target/wheel $(PY) -m maturin build \
		--release --strip --zig --compatibility manylinux_2_28 -i $(PY) --out $(WHEEL_DIR)
	@ls -l $(WHEEL_DIR)/disagg_rs-*.whl

.PHONY: readme
readme: build $(DEV_STAMP) ## Rewrite the README's console samples from fresh runs of their commands
	$(PY) tests/test_readme.py --write

.PHONY: demo
demo: build ## Run the main job: a disaggregated prefill (TP2) -> decode (TP1) run on CPU
	$(VENV)/bin/disagg-rs demo

.PHONY: bench
bench: build ## Run the benchmarks and write benches/RESULTS.md
	$(PY) benches/bench_planner.py --write benches/RESULTS.md
	$(PY) benches/bench_ledger.py --write benches/RESULTS.md
	$(PY) benches/bench_compiler.py --write benches/RESULTS.md
	$(PY) benches/bench_transport.py --write benches/RESULTS.md
	$(PY) benches/bench_reference.py --write benches/RESULTS.md
	$(PY) benches/bench_integrity.py --write benches/RESULTS.md
	$(PY) benches/bench_crossings.py --write benches/RESULTS.md
	$(PY) benches/bench_pull_host.py --write benches/RESULTS.md
	$(PY) benches/bench_control.py --write benches/RESULTS.md
	$(PY) benches/bench_coordinator.py --write benches/RESULTS.md
	$(PY) benches/bench_coordinator.py --sockets 300 --write benches/RESULTS.md
	$(PY) benches/bench_gpu.py --write benches/RESULTS.md
	$(PY) benches/bench_gpu.py --product --write benches/RESULTS.md

.PHONY: gpu
gpu: build $(DEV_STAMP) ## On a CUDA machine: the GPU tests (marker gpu), then the GPU bench
	$(PY) -m pytest -q -m gpu
	$(PY) benches/bench_gpu.py --write benches/RESULTS.md

.PHONY: fuzz
fuzz: build $(DEV_STAMP) ## Longer atheris run: wire decoders, coordinator, engine drivers (DISAGG_FUZZ_RUNS, default 200000)
	DISAGG_FUZZ_RUNS=$${DISAGG_FUZZ_RUNS:-200000} DISAGG_FUZZ_SECONDS=$${DISAGG_FUZZ_SECONDS:-10800} \
		$(PY) -m pytest -q tests/test_fuzz_atheris.py

.PHONY: clean
clean: ## Remove build outputs (keeps .venv)
	cargo clean
	rm -f python/disagg_rs/_core*.so

.PHONY: soak
soak: build ## Soak: 2,000 handoffs, faults at every stage incl. stalls past liveness, forged tickets, hostile clients (integrity off, the default)
	$(PY) -m disagg_rs.tools.soak --handoffs 2000
