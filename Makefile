# Two entry points: `make serve` (set up, then serve the embedded default model) and `make test`.
# TORCH_SPEC installs the CPU torch that lies on these machines' disk; GPU users override it,
# e.g. `make serve TORCH_SPEC=torch`.
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# tinker-cookbook pins tml-renderers>=0.4.1, which PyPI does not have (only Inkling/Kimi models use
# it), so it goes in without its deps; its other deps are in pyproject's test extra.
COOKBOOK_SPEC ?= tinker-cookbook==0.6.1
BIN := $(VENV)/bin

.PHONY: setup serve test test-matrix lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,fleet]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps "$(COOKBOOK_SPEC)"
	touch $@

serve: setup
	$(BIN)/mint serve

test: setup
	$(BIN)/ruff check mint_server tests benchmarks
	$(BIN)/python -m pytest -q

# The numerics suites under other CPUs' kernel choices (MKL's code paths, thread counts): a bound
# that holds only on this machine's MKL path, or a bitwise claim that holds only for its thread
# split, fails here (docs/numerics.md). .ci/run runs it after `make test`.
NUMERICS := tests/model tests/moe tests/mla tests/engine/test_sampling.py tests/engine/test_scheduling.py tests/engine/test_training.py \
	tests/engine/test_invariance.py
MATRIX := MKL_CBWR=COMPATIBLE MKL_CBWR=AVX2 OMP_NUM_THREADS=1 OMP_NUM_THREADS=2
test-matrix: setup
	@set -e; for env in $(MATRIX); do echo "== numerics under $$env"; \
		env $$env $(BIN)/python -m pytest -q -p no:warnings $(NUMERICS); done

lint: setup
	$(BIN)/ruff check mint_server tests benchmarks
