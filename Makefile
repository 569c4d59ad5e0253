# Two commands do all setup on a fresh machine: `make test` and `make demo`.
# torch is installed first and explicitly (the CPU build of $(TORCH_VERSION)): a loose `torch`
# requirement on a machine without it would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.ckptools-installed

.PHONY: test check demo lint typecheck unit setup clean bench

# pytest-xdist workers: three on the 2-core machines this suite is sized for, because a worker
# spends much of its time waiting (on rank processes, torchrun, disk): with two, the cores were
# busy 58 % of a run; three took the idle re-run from 11 min 47 s to 10 min 41 s (2026-11-27).
# Files are dealt whole to a worker (--dist loadfile), so module-scoped producers run once, the
# longest first (tests/support/file_order.py; --no-loadscope-reorder keeps that order).
TEST_WORKERS ?= 3
# PYTHONDONTWRITEBYTECODE emptied: where the environment sets it (this project's machines do),
# every process the suite starts compiled ckptools from source again and every pytest worker
# rewrote every test module's asserts again; cached (in __pycache__, ignored by git), a re-run
# collects in 12 s instead of 19, and `python -m ckptools --help` starts in 0.13 s, not 0.20.
PYTEST := DS_ACCELERATOR=cpu PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

setup: $(STAMP)

# DS_BUILD_OPS=0: DeepSpeed (a dev dependency) installs as pure Python, no ops compiled.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check ckptools tests fixtures bench examples
	$(VENV)/bin/ruff format --check ckptools tests fixtures bench examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# DS_ACCELERATOR=cpu: the DeepSpeed tests run its engines on CPU ranks (gloo). Producer outputs
# are kept across runs (tests/support/cache.py; CKPTOOLS_TEST_CACHE=off builds them afresh).
test: lint typecheck
	$(PYTEST)

# The inner loop: lint, types, and the unit and integration tests that start no rank processes
# (the slow soaks, such as the kill sweeps, run in `make test`).
check: lint typecheck
	$(PYTEST) -m "not distributed and not slow" tests/unit tests/integration

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

demo: $(STAMP)
	bash examples/demo.sh

clean:
	rm -rf $(VENV) demo_out .pytest_cache .mypy_cache .ruff_cache
