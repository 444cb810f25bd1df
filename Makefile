# The README's two commands call these targets; CI calls `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint check-kernels gpu-test clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml tests/plugins/strata_testfmt/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]' ./tests/plugins/strata_testfmt
	touch $@

demo: setup
	$(BIN)/strata run configs/demo.yaml

lint: setup
	$(BIN)/ruff check .

check-kernels: setup
	$(BIN)/strata check-kernels

test: lint check-kernels
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
