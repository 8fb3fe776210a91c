# The two commands (README): `make demo` runs the main job on the packaged esmc-tiny, `make test`
# runs the tests. Each creates .venv on first use with the pinned versions (.ci/constraints.txt)
# and installs again whenever pyproject.toml or the constraints change.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= -q

.PHONY: demo test lint install clean

demo: $(STAMP)
	$(BIN)/esmc-convert tiny -o esmc-tiny-4bit --q 4 --force
	$(BIN)/esmc-mlx info esmc-tiny-4bit

# PATH as an activated venv has it: tests start the console scripts (esmc-convert) by name.
test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest $(PYTEST_ARGS)

# ruff, configured in pyproject.toml: lint, and the formatter's check (`ruff format .` fixes it).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

install: $(STAMP)

# torch first and pinned: with no torch present, an unpinned one pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c .ci/constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c .ci/constraints.txt -e ".[dev]"
	touch $@

clean:
	rm -rf $(VENV) esmc-tiny-4bit
