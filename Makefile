# The two commands a new user needs: `make serve` runs the default job, `make test` runs the tests.
# Both create (or reuse) .venv and install what they need; torch is pinned to $(TORCH), which pip resolves to the
# local CPU wheel on this project's machines (from PyPI alone, Linux x86-64 gets the CUDA build).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
NP ?= 4

.PHONY: serve test install clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[cpu,test,bench]"
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/mpiexec -n $(NP) $(BIN)/splash-serve --config configs/cpu.yaml

test: install
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m pytest tests -n 2

clean:
	rm -rf $(VENV) build *.egg-info
