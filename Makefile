# One entry point. `make serve` runs Shoal on the model the project makes; `make test` runs the
# whole suite. Both create the virtual environment on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CACHE ?= $(HOME)/.cache/shoal
MODEL ?= $(CACHE)/models/shoal-tiny
export SHOAL_CACHE := $(CACHE)

.PHONY: venv serve test test-unit test-process test-k8s test-e2e lint bench clean cluster cluster-down

$(BIN)/.installed: pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned to the CPU wheel on disk; a newer or unpinned torch would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all]'
	touch $@

venv: $(BIN)/.installed

serve: venv
	test -f $(MODEL)/config.json || $(BIN)/shoal make-model $(MODEL)
	$(BIN)/shoal serve $(MODEL) --served-model-name shoal-tiny --host 127.0.0.1 --port 8000

# The whole system on a local cluster with two real nodes (docs/cluster.md): builds what is
# missing (Kubernetes from Debian's source, the images), installs the chart, applies
# examples/cluster-hostpath.yaml and waits for a completion through the Service. Needs root.
# kubectl and helm: tests/support/k8s_tools.py (installed once into the cache, prints the paths).
cluster: venv
	test -f $(MODEL)/config.json || $(BIN)/shoal make-model $(MODEL)
	$(BIN)/python -m shoal.devcluster demo --model $(MODEL) \
	    $$($(BIN)/python tests/support/k8s_tools.py | sed -E 's/^(kubectl|helm): +/--\1 /')

# Standard library only: runs without the venv.
cluster-down:
	PYTHONPATH=devcluster $(PY) -m shoal.devcluster stop

# The whole suite: lint, then every tier (what .ci/run runs): the e2e tier side by side with
# the others (tests/support/run_suite.py says why). One tier alone: make test-unit,
# test-process, test-k8s, test-e2e (tests/conftest.py says what each holds).
# --durations: each ends with its slowest steps (the tier budget's evidence).
test: lint
	$(BIN)/python tests/support/run_suite.py $(PYTEST_ARGS)

test-unit test-process test-k8s test-e2e: test-%: venv
	$(BIN)/python -m pytest -q -m $* $(PYTEST_ARGS)

# ruff (pyproject's [tool.ruff], line length 100) and the import contracts between components.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

# One benchmark script with the test support on the path (models, servers, the cluster):
# make bench B=throughput ARGS="--model tiny"   (benchmarks/README.md lists them)
bench: venv
	PYTHONPATH=tests $(BIN)/python benchmarks/$(B).py $(ARGS)

clean:
	rm -rf $(VENV)
