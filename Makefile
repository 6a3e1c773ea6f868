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

.PHONY: setup run test test-main clean

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

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# ---------------------------------------------------------------------------------------------
# Ascend (Triton-Ascend) section: the Ascend engineer defines `test-ascend` (and `ascend-env`)
# here; `make test` picks `test-ascend` up automatically.
# ---------------------------------------------------------------------------------------------
