# fqr: two commands on a fresh machine (see README.md)
#   make run    set up .venv, then `fqr verify` on the bundled goldens with every backend present
#   make test   set up .venv, then the whole test suite (main tests, then the Ascend checks)
#
# Set-up is idempotent: a stamp file records it, and it reruns only when pyproject.toml changes.
# Without `nvidia-smi` torch==2.13.0 is installed first, so pip never pulls a multi-GB CUDA build
# (on a machine without a local CPU wheel: make run TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu").

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?= -q
VERIFY_ARGS ?=

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.fqr-setup.stamp
HAVE_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)

.PHONY: setup run test test-main lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifneq ($(HAVE_NVIDIA),yes)
	$(PIP) install "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
endif
	$(PIP) install -e '.[triton,dev]'
	touch $(STAMP)

run: setup
	$(VENV)/bin/fqr verify $(VERIFY_ARGS)

# pytest exits 5 when it collects nothing: not a failure for the suite as a whole.
test-main: setup
	$(PY) -m pytest $(PYTEST_ARGS) || [ $$? -eq 5 ]

# `make test` runs the main tests, then `test-ascend` when that target exists (section below).
test: test-main
	@if $(MAKE) -n test-ascend >/dev/null 2>&1; then $(MAKE) test-ascend; fi

# Lint: ruff (rules and layout, pyproject.toml [tool.ruff]) on the whole tree, and mypy on the
# functional core, the ops and the lowering (pyproject.toml [tool.mypy]).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache

# ---------------------------------------------------------------------------------------------
# Ascend (Triton-Ascend) section: the Ascend engineer defines `test-ascend` (and `ascend-env`)
# here; `make test` picks `test-ascend` up automatically.
# ---------------------------------------------------------------------------------------------

ASCEND_VENV ?= .venv-ascend
ASCEND_PY := $(ASCEND_VENV)/bin/python
ASCEND_FQR := $(ASCEND_VENV)/bin/fqr

.PHONY: ascend-env test-ascend

# A second virtual environment (upstream triton and triton-ascend both install `triton`):
# CPU torch, triton-ascend 3.2.0, pybind11, fqr itself (editable, no deps). Idempotent (stamp).
ascend-env:
	bash scripts/ascend-env.sh $(ASCEND_VENV)

# 1. the compile check: every preset at TP 1/2/4/8/16 through TTIR and triton-adapter-opt
#    (Ascend linalg/HIVM for Ascend910B3; bishengir needs CANN and is reported, not failed);
# 2. the ascend-target kernel under Triton-Ascend's interpreter on every golden case;
# 3. tests/ascend: the compile tests in a compiling process, then the interpreter tests
#    (multi-tile cases where vllm-ascend's kernel breaks, head chunks) and the profile tests.
test-ascend: ascend-env
	$(ASCEND_FQR) lower --target ascend --check
	$(ASCEND_FQR) verify --backend ascend-interpret
	TRITON_INTERPRET=0 $(ASCEND_PY) -m pytest tests/ascend/test_ascend_compile.py $(PYTEST_ARGS)
	TRITON_INTERPRET=1 $(ASCEND_PY) -m pytest tests/ascend --ignore=tests/ascend/test_ascend_compile.py $(PYTEST_ARGS)
