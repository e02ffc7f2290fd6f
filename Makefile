# Two entry points for a fresh machine: `make demo` trains, `make test` runs the suite. Each creates .venv
# when it is missing; the demo installs the project alone, the suite the project with its `dev` extra.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test test-fast lint bench gpu-check check-cupy-api docs-config clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

# The demo's text: Python's reference manual as `help()` shows it (in every CPython), with a BPE tokenizer
# trained on it, so that the sample reads as words (examples/data/make_demo_corpus.py); prepared once.
DEMO_DATA := data/demo
$(DEMO_DATA)/prepared/index.json: examples/data/make_demo_corpus.py | $(DEMO_STAMP)
	rm -rf $(DEMO_DATA)/prepared
	$(BIN)/python examples/data/make_demo_corpus.py $(DEMO_DATA)
	$(BIN)/raypar prepare '$(DEMO_DATA)/docs/*.txt' --tokenizer $(DEMO_DATA)/tokenizer.json \
		--out $(DEMO_DATA)/prepared --no-progress

# Trains `small` on it into runs/demo, checkpoints the last step, draws the pictures (`wrote
# runs/demo/loss.png`) and prints what the model writes after the prompt. A second `make demo` is refused in
# one line: runs/demo holds the first run (`rm -rf runs/demo` trains it again; `raypar train ... --resume
# latest` continues it). 2.5x small.toml's learning rate: 120 steps end at validation loss 5.52, not 5.64
# (same steps, same wall time; the manual's 51K tokens are seen 4.5 times). The sample is drawn on one
# thread: a token's few small matrix-vector products gain nothing from two, and on a busy machine each
# waits at the second thread's barrier (50 tokens: 3.3 s on one thread, 67 s on two, 2 cores at load 20-35).
demo: $(DEMO_STAMP) $(DEMO_DATA)/prepared/index.json
	$(BIN)/raypar train examples/configs/small.toml --name demo --run-dir runs/demo \
		--set data.source=data/demo/prepared --set data.val_fraction=0.1 --set train.lr=5e-3 \
		--set train.min_lr=5e-4 --set checkpoint.dir=runs/demo/checkpoints --set checkpoint.every=1000000
	$(BIN)/raypar report runs/demo
	@echo "What 120 steps on Python's reference manual taught the model to write after \"The\":"
	OMP_NUM_THREADS=1 $(BIN)/raypar generate runs/demo/checkpoints --prompt "The" --max-tokens 120 \
		--temperature 0.7 --top-p 0.9

# The thread-rank numerics that a CPU's instruction set can move (bf16 rounding, GEMM blocking) run once more
# with ATen and oneDNN held to AVX2: a tolerance that fits only the machine at hand fails on the next one.
# On a CPU without AVX-512 (so without AMX or avx512_bf16 either) AVX2 is already what both pick, and the
# unit tier ran these tests there: the pass would repeat it, so it is skipped, saying so.
# What it runs, and why each: the 16-bit numerics whole (precision: bf16/fp16 curves against fp32, across
# layouts, the masters' rounding, each with its controls; the scaler's state machine rides along, cheap); the
# bf16 bounds of compress and its float64 PowerSGD/top-k exactness (QR and GEMMs through LAPACK/BLAS); of
# dp_strategy and offload only their bf16-parameter cases (a flipped bf16 rounding moved grad norms 2.4e-4 on
# AMX, 6e-5 under AVX2): their fp32 cases differ from zero 0 in the gloo sum order alone, their bytes and
# checkpoints in nothing an ISA moves; and the fp32 layout equivalences whose tp ranks multiply other GEMM
# shapes than the one-process run (model, tp_layers, executor_equivalence, sequence_parallel: GEMM blocking).
AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo yes)
ISA_TESTS := $(addprefix tests/unit/test_,precision.py model.py tp_layers.py executor_equivalence.py \
	sequence_parallel.py compress.py::test_bf16_within_bound_and_replicas_agree \
	compress.py::test_bf16_reduce_scatter_within_bound compress.py::test_lossless_settings_equal_the_plain_average \
	dp_strategy.py::test_bf16_parameters_with_fp32_masters_match_zero0 offload.py::test_offload_bf16_parameters_match)
PYTEST := $(BIN)/python -m pytest -q -ra --durations=25
# A worker per core (pytest-xdist), a file's tests on one worker so that its module fixtures (a run, a
# cluster) are built once. No tier keeps the cores busy alone: thread ranks mostly wait on each other, a Ray
# test on actor starts and timeouts (one tier after the other, the cores were ~70 % busy; side by side ~95 %).
ACROSS_CORES := -n auto --maxprocesses=4 --dist loadfile

# An editable install leaves the project's own sources without bytecode (pip compiles only what it copies),
# and where PYTHONDONTWRITEBYTECODE is set (this workplace's machines set it) every process compiles them
# again on import: each actor of every Ray test, ~0.2 s apiece. Compiled once here (changed files only).
SOURCES := raypar actors collectives tests benchmarks
BYTECODE := $(BIN)/python -m compileall -q $(SOURCES)

# The suite by what a test needs (docs/testing.md): unit (one process, thread ranks), ray (a session Ray per
# worker), cluster (subprocess runs that start their own Ray or clusters, benchmarks' --quick runs). The three
# tiers in one pytest across the cores, in the order given (xdist would otherwise start the files with the
# most tests first): the cluster tier's long files first, so that the unit tier's short ones fill the end.
# test_job_submit alone after them: beside the other worker's Rays and clusters, a job's driver once failed to
# join its cluster ("Failed to connect to Ray cluster"; the cause unknown: Ray's message hid it, raypar's now
# adds it); alone, and in another run side by side, it passed.
JOBS := tests/ray/test_job_submit.py
test: $(STAMP)
	$(BIN)/ruff check raypar actors collectives tests benchmarks examples
	$(BIN)/lint-imports
	$(BYTECODE)
	$(PYTEST) $(ACROSS_CORES) --no-loadscope-reorder --deselect $(JOBS) tests/cluster tests/ray tests/unit
	$(PYTEST) $(JOBS)
ifeq ($(AVX512),yes)
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(BIN)/python -m pytest -q -ra $(ACROSS_CORES) $(ISA_TESTS)
else
	@echo "AVX2 pass skipped: this CPU has no AVX-512, so the unit tier already ran its numerics at AVX2"
endif

# The edit loop: the unit tier alone (no Ray), a few minutes.
test-fast: $(STAMP)
	$(BYTECODE)
	$(PYTEST) $(ACROSS_CORES) tests/unit

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# docs/config.md's "Config reference" section, rewritten from each key's help in raypar/core/config/schema.py
# (tests/unit/test_config_reference.py fails while the page is stale).
docs-config: $(STAMP)
	$(BIN)/python -m raypar.core.config.reference

bench: $(STAMP)
	$(BIN)/python benchmarks/collectives.py

# On a GPU machine, with that machine's own python3 and its CUDA torch, CuPy and ml_dtypes: no venv and no
# install (the venv's pinned torch is a CPU wheel where this workplace's registry serves it, and the lent
# GPU machine reaches no registry). Ray must be importable: on the lent GPU machine it travels as wheels
# (tests/gpu/gpu_wheels.sh), and the check is split over two device calls there (docs/gpu.md has the
# commands). Fails at once without CUDA. One JSON line per row.
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) tests/gpu/gpu_check.py --require-gpu

# The NCCL stand-in (tests/support/fake_nccl.py) against the real CuPy and NCCL, which import without a GPU:
# installed into a folder of their own (~500 MB, not into the venv: `make test` stays as fast as it is), the
# NCCL pin the one CuPy 14.2's wheel was built with (cupy/.data/_wheel.json); --no-deps keeps the venv's numpy
# the only one. No GPU needed.
CUPY_SITE ?= .cupy-site
check-cupy-api: $(STAMP)
	test -f $(CUPY_SITE)/.installed || ( $(BIN)/python -m pip install -q --no-deps --target $(CUPY_SITE) \
		cupy-cuda13x==14.2.0 nvidia-nccl-cu13==2.27.7 cuda-pathfinder==1.9.1 && touch $(CUPY_SITE)/.installed )
	PYTHONPATH=$(CURDIR):$(abspath $(CUPY_SITE)) $(PYTEST) -p no:cacheprovider tests/unit/test_cupy_api.py

clean:
	rm -rf $(VENV) runs $(CUPY_SITE)
