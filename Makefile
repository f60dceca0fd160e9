# Two entry points: `make demo` runs kinference end to end on embedded defaults, `make test` runs the tests.
# Each creates its own virtualenv in $(VENV) and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch. On a GPU machine install a CUDA build of torch first (see README), or set
# TORCH_SPEC to the build you want; kinference accepts any torch >= 2.2.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.kinference-installed

.PHONY: install demo test lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/kinference demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check kinference consumer handlers loadgen tests

clean:
	rm -rf $(VENV) kinference-demo-output .pytest_cache
