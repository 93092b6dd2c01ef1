# Two entry points: `make serve` (set up, then serve the embedded default model) and `make test`.
# TORCH_SPEC installs the CPU torch that lies on these machines' disk; GPU users override it,
# e.g. `make serve TORCH_SPEC=torch`.
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# tinker-cookbook pins tml-renderers>=0.4.1, which PyPI does not have (only Inkling/Kimi models use
# it), so it goes in without its deps; its other deps are in pyproject's test extra.
COOKBOOK_SPEC ?= tinker-cookbook==0.6.1
BIN := $(VENV)/bin

.PHONY: setup serve test lint
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

lint: setup
	$(BIN)/ruff check mint_server tests benchmarks
