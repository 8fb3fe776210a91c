# The two commands (README): `make demo` runs the main job on the packaged esmc-tiny, `make test`
# runs the tests. Each creates .venv on first use with the pinned versions (.ci/constraints.txt)
# and installs again whenever pyproject.toml or the constraints change.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= -q
# PyPI's Linux torch is the CUDA build (~530 MB, plus cuDNN, NCCL and the CUDA libraries). On Linux
# without an NVIDIA GPU the CPU build comes from PyTorch's own index instead: an extra index, so
# pip takes 2.13.0+cpu there over PyPI's 2.13.0. An index that does not answer is left out, with a
# note (pip would retry it for every package and then go on without it): torch then comes from
# PyPI, or a wheel at hand. Decided only when installing. `make install TORCH_INDEX=` turns it
# off; scripts/check_torch_index.py shows what pip would download.
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu
ANSWERS := import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=15)
TORCH_INDEX ?= $(shell [ "$$(uname -s)" = Linux ] && ! nvidia-smi -L >/dev/null 2>&1 && { \
  $(PYTHON) -c '$(ANSWERS)' $(CPU_TORCH_INDEX)/torch/ 2>/dev/null && echo $(CPU_TORCH_INDEX) \
  || echo "$(CPU_TORCH_INDEX) does not answer: torch from PyPI or a wheel at hand" >&2; })

.PHONY: demo test lint install package clean

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

# torch first and pinned, from TORCH_INDEX where set: with no torch present, an unpinned one pulls a
# multi-GB CUDA build. The second step finds it installed and leaves it.
$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c .ci/constraints.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch==2.13.0
	$(BIN)/python -m pip install -q -c .ci/constraints.txt -e ".[dev]"
	touch $@

# The sdist and the wheel (python -m build into dist/), twine's check, and the wheel installed in a
# fresh venv running esmc-convert and esmc-mlx from outside the clone (scripts/check_package.py).
package: $(STAMP)
	$(BIN)/python scripts/check_package.py

clean:
	rm -rf $(VENV) esmc-tiny-4bit dist
