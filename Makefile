# Two entry points for a fresh machine: `make demo` trains, `make test` runs the suite.
# Both create .venv when it is missing and install the project (with its pinned deps) into it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# Trains, checkpoints the last step, then prints what the model writes after "def ".
demo: $(STAMP)
	$(BIN)/raypar train examples/configs/small.toml --name demo --run-dir runs/demo \
		--set checkpoint.dir=runs/demo/checkpoints --set checkpoint.every=1000000
	$(BIN)/raypar generate runs/demo/checkpoints --prompt "def " --max-tokens 300 --temperature 0.7

test: $(STAMP)
	$(BIN)/ruff check raypar actors collectives tests benchmarks examples
	$(BIN)/python -m pytest -q -ra tests

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/collectives.py

# On a machine with one GPU (CuPy from the `gpu` extra): NCCL ops, a llama-1b bf16 step against plain
# PyTorch, two stages sharing the GPU, a checkpoint round trip. One JSON line per result; < 8 minutes.
gpu-check: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[gpu]'
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) runs
