# fedvox — two commands on a fresh machine:
#   make demo   generate the embedded corpus, train, evaluate, write a report
#   make test   lint (ruff, import layers) and run the test suite (with the deploy and ray extras)
# Each installs what it needs into .venv first (torch pinned to the local CPU wheel).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fedvox-installed
# the deploy (Flower) and ray extras on top, for `make test` only: their tests run in CI,
# while `make demo` stays lean
DEPLOY := $(VENV)/.fedvox-extras-installed

.PHONY: demo test test-slow lint bench install clean numbers

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and exactly: any looser request would pull a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(DEPLOY): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,deploy,ray]'
	# neither Flower nor Ray may move torch off the pinned CPU wheel
	$(BIN)/python -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
	touch $(DEPLOY)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/fedvox demo

test: $(DEPLOY)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	FEDVOX_REQUIRE_DEPLOY=1 FEDVOX_REQUIRE_RAY=1 $(BIN)/pytest -q -m "not slow"

# the tests marked slow: Flower federations on loopback (SuperLink + SuperNodes as processes,
# about 7 minutes here); kept out of `make test` to hold CI near 10 min
test-slow: $(DEPLOY)
	FEDVOX_REQUIRE_DEPLOY=1 FEDVOX_REQUIRE_RAY=1 $(BIN)/pytest -q -m slow

# Regenerate the demo numbers the README quotes (docs/results/demo.json; a test checks the
# README against that file). Run on a quiet machine: it also records the wall time.
numbers: $(STAMP)
	$(BIN)/fedvox demo --out runs/numbers --quiet --results docs/results/demo.json

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_generate.py
	$(BIN)/python benchmarks/bench_features.py
	$(BIN)/python benchmarks/bench_threads.py

clean:
	rm -rf $(VENV) .cache runs
