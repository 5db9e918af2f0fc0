# prx-assets: every target sets itself up (make install is idempotent).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export DAGSTER_HOME := $(CURDIR)
export PRX_DATA_ROOT ?= $(CURDIR)/data
export PRX_SOURCES ?= $(CURDIR)/sources.yaml
export HF_HUB_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
export RAY_ENABLE_UV_RUN_RUNTIME_ENV := 0

.PHONY: install chromium exiftool demo test test-fast test-soak lint bench bench-incremental ui validate browse clean

# The image stage's Pillow build goes in last (scripts/image_backend.sh says why); every
# install also puts the cached pillow-simd wheel back if a pip run replaced it since.
install: chromium exiftool $(STAMP)
	@scripts/image_backend.sh $(VENV) ensure

# The browser tests drive Debian's chromium through Playwright, which cannot download
# browsers here; installed once when missing (as root, or through sudo).
chromium:
	@command -v chromium >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; }

# The rights tests write real XMP with exiftool (prx_assets/testing/rights_fixtures.py).
exiftool:
	@command -v exiftool >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q libimage-exiftool-perl; }

$(STAMP): pyproject.toml scripts/image_backend.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# pillow-simd's wheel builds (about 2 min of compiler) while pip installs the rest.
	scripts/image_backend.sh $(VENV) prebuild & prebuild=$$!; \
	$(BIN)/pip install -q -e '.[test]'; rc=$$?; wait $$prebuild; exit $$rc
	scripts/image_backend.sh $(VENV) build
	touch $(STAMP)

demo: install
	$(BIN)/prx-assets demo

# Lint, layering and types gate the tests: ruff over the repo and the import contracts
# (lint-imports, [tool.importlinter] in pyproject.toml) first; mypy over the package beside
# the tests (a cold mypy takes ~2 min of one core, the tests' long last files leave a core
# idle), its findings printed and failing the target at the end.
# Tests run in TEST_WORKERS processes, each test file whole in one (its module fixtures
# built once); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile
# The five-cycle soak of a fixed seed runs here; its two S3 cycles (`soak` mark: the S3
# server's start and minutes of CPU) only in `make test-soak`, so `make test` stays under
# 15 minutes on 2 cores.
test: PYTEST_ARGS ?= -m "not soak"
test: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	@types_log=$$(mktemp); $(BIN)/mypy >"$$types_log" 2>&1 & types=$$!; \
	$(PYTEST) $(PYTEST_ARGS); tests_rc=$$?; wait $$types; types_rc=$$?; \
	echo "mypy:"; cat "$$types_log"; rm -f "$$types_log"; \
	exit $$(( tests_rc || types_rc ))

# The tests that need no subprocess run, whole graph, S3 server, Ray (the embedded one-node
# cluster or a multi-node one) or browser (the marks in pyproject.toml), after ruff and the
# import contracts; no mypy (`make lint`). About 2.5 min on 2 cores.
FAST := not e2e and not s3 and not cluster and not ray and not browser
test-fast: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(PYTEST) -m "$(FAST)" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# PRX_INCREMENTAL_IMAGES sizes bench.incremental inside `make bench` (default a smoke run);
# PRX_BENCH_RIGHTS_PAIRS, _INGEST_PAIRS and _E2E_RUNS size bench.rights, _SETS picks its sets
# (plain, mixed; docs/rights.md, Cost).
bench: install
	$(BIN)/python -m bench.run_all

# The fault soak's tests (prx_assets_tests/bench/test_soak.py): five cycles of a fixed seed
# on local disk, two with the data root in a bucket of the S3 test server.
test-soak: install
	$(BIN)/python -m pytest -q -p no:cacheprovider prx_assets_tests/bench/test_soak.py

# Incremental reruns and a killed, resumed image stage: make bench-incremental IMAGES=2000
bench-incremental: install
	$(BIN)/python -m bench.incremental --images $(or $(IMAGES),200)

ui: install
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

browse: install
	$(BIN)/prx-assets browse --host 127.0.0.1 --port 8080

validate: install
	$(BIN)/dagster definitions validate -w workspace.yaml

clean:
	rm -rf data demo_corpus .dagster_home storage history logs schedules bench/out

# --- The GPU stack (docs/captions.md, "The GPU stack") ------------------------------------
# What vLLM, torch, torchvision and transformers a GPU machine gets is read from the
# registry at run time: the vLLM that the installed Ray's `ray[llm]` names, and the releases
# it pins. uv installs them with explicit overrides; prx_assets/models/gpu_stack.py says why.
GPU_STACK := $(BIN)/python -m prx_assets.models.gpu_stack
TF5 := .venv-tf5
TF5_TESTS := prx_assets_tests/stages/captions prx_assets_tests/stages/labels \
  prx_assets_tests/stages/attributes prx_assets_tests/bench
.PHONY: install-gpu check-gpu-deps test-transformers5

# A CUDA Linux x86-64 machine: the CPU install, then the GPU stack over it.
install-gpu: $(STAMP)
	$(GPU_STACK) install
	@scripts/image_backend.sh $(VENV) ensure

# CI: the GPU stack still resolves for Linux x86-64 / CUDA, from metadata alone (~20 s).
check-gpu-deps: $(STAMP)
	$(GPU_STACK) check

# The captioning, labels, attributes and bench tests on the GPU stack's transformers 5 (the
# CPU torch kept), in a venv of their own.
test-transformers5: $(STAMP)
	test -x $(TF5)/bin/python || $(PYTHON) -m venv $(TF5)
	$(GPU_STACK) install --python $(TF5)/bin/python --extra test --only transformers \
	  --no-ray-llm
	$(TF5)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
	  $(TF5_TESTS) $(PYTEST_ARGS)
