# Two commands do all the set-up: `make demo` and `make test` each create the in-repo
# virtual environment (.venv) on first use and install tpdp-verify into it, editable.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[hf,torchtitan,xdist]'
	touch $(STAMP)

# The gate exits 1 when it finds a divergence in torch: that is a result the demo shows,
# not a failure of the demo. Usage (2) and infrastructure (3) errors still fail it. The gate
# says its own next steps (the baseline, explain); the demo adds the one for a user's plan.
demo: $(STAMP)
	@$(BIN)/tpdp-verify gate --profile smoke; rc=$$?; \
	if [ $$rc -eq 1 ]; then echo "demo: the gate found divergences in torch (above); exit code 1 is that verdict"; fi; \
	echo "your own TP plan: $(BIN)/tpdp-verify plan MODULE:MAKE_MODEL --plan MODULE:PLAN --input MODULE:INPUTS (docs/user-guide.md)"; \
	test $$rc -eq 0 -o $$rc -eq 1

# Two workers, a test file each at a time: half the suite's time is its ranks and gates
# waiting (process starts, timeouts, gloo), which the other worker fills (docs/performance.md).
# The files handed out longest first, in tests/conftest.py's order (not xdist's, by count).
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(BIN)/python bench/bench_pool.py
	$(BIN)/python bench/bench_ranks.py
	$(BIN)/python bench/bench_wire.py
	$(BIN)/python bench/bench_plan.py
	$(BIN)/python bench/bench_training.py
	$(BIN)/python bench/bench_tolerance.py
	$(BIN)/python bench/bench_mutation.py
	$(BIN)/python bench/bench_endurance.py
	$(BIN)/python bench/bench_large_dp.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
