# The README's two commands call these targets; CI calls `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup setup-test demo test lint typecheck check-kernels dist clean

# strata_rt alone: what `make demo` needs
setup: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $@

# plus the test extras and the entry-point test plugin (editable: its module and kernels are
# read from tests/plugins, while its entry point is published like any installed plugin's)
setup-test: $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed tests/plugins/strata_testfmt/pyproject.toml
	$(BIN)/python -m pip install -q -e '.[test]' -e ./tests/plugins/strata_testfmt
	touch $@

demo: setup
	$(BIN)/strata run configs/demo.yaml

lint: setup-test
	$(BIN)/ruff check .

# the type checker reads its settings (files, strictness) from setup.cfg's [mypy]
typecheck: setup-test
	$(BIN)/mypy

check-kernels: setup-test
	$(BIN)/strata check-kernels

test: lint typecheck check-kernels
	$(BIN)/python -m pytest -q

# the sdist and wheel a user installs (`pip install dist/strata_rt-*.whl`)
dist: setup-test
	$(BIN)/python -m build --outdir dist .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache dist
