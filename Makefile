# fqr: two commands on a fresh machine (see README.md)
#   make run    set up .venv with what `fqr verify` needs (fqr, torch, and upstream Triton where
#               it installs: Linux), then `fqr verify` on the bundled goldens with every backend
#   make test   set up .venv with the dev extras too (and .venv-ascend), run the main suite and
#               the Ascend checks, and end with one summary line for the whole run
#
# Set-up is idempotent: stamp files record it, and it reruns only when pyproject.toml changes.
# Without `nvidia-smi` torch==2.13.0 is installed first, so pip never pulls a multi-GB CUDA build
# (on a machine without a local CPU wheel: make run TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu").

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?= -q
VERIFY_ARGS ?=
# Where `make test` records each step's exit status and JUnit XML (scripts/test_summary.py).
TEST_RESULTS ?= .test-results

PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.fqr-run.stamp
STAMP := $(VENV)/.fqr-setup.stamp
HAVE_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
# Upstream Triton publishes wheels for Linux only: elsewhere `make run` verifies the reference
# backend alone (and `fqr verify` says why it skipped the others).
RUN_EXTRAS := $(if $(filter Linux,$(shell uname -s)),[triton],)

.PHONY: setup setup-run run test test-main lint clean

setup-run: $(RUN_STAMP)

# `make run`: fqr and the triton extra only (no test, lint or plotting tools).
$(RUN_STAMP): pyproject.toml
	@echo "setting up $(VENV) for fqr verify (once; again when pyproject.toml changes)" >&2
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifneq ($(HAVE_NVIDIA),yes)
	@scripts/pip_install.sh $(PY) "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
endif
	@scripts/pip_install.sh $(PY) -e '.$(RUN_EXTRAS)'
	@touch $(RUN_STAMP)

# `make test` / `make lint`: the dev extras on top.
setup: $(STAMP)

$(STAMP): $(RUN_STAMP)
	@echo "adding the dev extras to $(VENV) (once; again when pyproject.toml changes)" >&2
	@scripts/pip_install.sh $(PY) -e '.[triton,dev]'
	@touch $(STAMP)

run: setup-run
	@$(VENV)/bin/fqr verify $(VERIFY_ARGS)

# pytest exits 5 when it collects nothing: not a failure for the suite as a whole.
test-main: setup
	$(PY) -m pytest $(PYTEST_ARGS) || [ $$? -eq 5 ]

# `make test`: every step runs (scripts/test_step.sh records its exit status), the main suite,
# then the Ascend section's `ascend-env` and `test-ascend` when that section exists (below);
# the last line is scripts/test_summary.py's one line for the whole run, and its exit status
# is the run's.
test: setup
	@rm -rf $(TEST_RESULTS) && mkdir -p $(TEST_RESULTS) && date +%s >$(TEST_RESULTS)/start
	@scripts/test_step.sh $(TEST_RESULTS) main $(PY) -m pytest $(PYTEST_ARGS) --junitxml=$(TEST_RESULTS)/main.xml
	@if $(MAKE) -n test-ascend >/dev/null 2>&1; then \
		scripts/test_step.sh $(TEST_RESULTS) ascend-env $(MAKE) --no-print-directory ascend-env; \
		if [ "$$(cat $(TEST_RESULTS)/ascend-env.rc)" = 0 ]; then \
			$(MAKE) --no-print-directory test-ascend STEP="scripts/test_step.sh $(TEST_RESULTS)"; \
		fi; \
	fi
	@$(PY) scripts/test_summary.py $(TEST_RESULTS) "$$(cat $(TEST_RESULTS)/start)"

# Lint: ruff (rules and layout, pyproject.toml [tool.ruff]) on the whole tree, and mypy on the
# functional core, the ops and the lowering (pyproject.toml [tool.mypy]).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache $(TEST_RESULTS)

# ---------------------------------------------------------------------------------------------
# Ascend (Triton-Ascend) section: the Ascend engineer defines `test-ascend` (and `ascend-env`)
# here; `make test` picks `test-ascend` up automatically.
# ---------------------------------------------------------------------------------------------

ASCEND_VENV ?= .venv-ascend
ASCEND_PY := $(ASCEND_VENV)/bin/python
ASCEND_FQR := $(ASCEND_VENV)/bin/fqr

.PHONY: ascend-env test-ascend

# `make test` sets STEP to scripts/test_step.sh RESULTS: each command below is then recorded as
# a step of the run's summary (pytest steps also write JUnit XML) and the next one still runs.
# Alone (`make test-ascend`), STEP is empty and the first failing command stops the target.
STEP ?=
step = $(if $(STEP),$(STEP) $(1) )
junit = $(if $(STEP),--junitxml=$(TEST_RESULTS)/$(1).xml)

# A second virtual environment (upstream triton and triton-ascend both install `triton`):
# CPU torch, triton-ascend 3.2.0, pybind11, fqr itself (editable, no deps). Idempotent (stamp).
ascend-env:
	bash scripts/ascend-env.sh $(ASCEND_VENV)

# 1. the compile check: every preset at TP 1/2/4/8/16 through TTIR and triton-adapter-opt
#    (Ascend linalg/HIVM for Ascend910B3; bishengir needs CANN and is reported, not failed),
#    and each projected form (the QKV GEMM + prologue on the cube) at its smallest and largest TP;
# 2. the ascend-target kernel under Triton-Ascend's interpreter on every golden case;
# 3. tests/ascend: the compile tests in a compiling process, then the interpreter tests
#    (multi-tile cases where vllm-ascend's kernel breaks, head chunks) and the profile tests.
test-ascend: ascend-env
	$(call step,ascend-compile-sweep)$(ASCEND_FQR) lower --target ascend --check
	$(call step,ascend-verify)$(ASCEND_FQR) verify --backend ascend-interpret
	$(call step,ascend-compile-tests)env TRITON_INTERPRET=0 $(ASCEND_PY) -m pytest tests/ascend/test_ascend_compile.py $(PYTEST_ARGS) $(call junit,ascend-compile-tests)
	$(call step,ascend-interpreter-tests)env TRITON_INTERPRET=1 $(ASCEND_PY) -m pytest tests/ascend --ignore=tests/ascend/test_ascend_compile.py $(PYTEST_ARGS) $(call junit,ascend-interpreter-tests)
