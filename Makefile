# The two commands the README promises. Both build .venv from nothing on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# The scheduler's core compiled with mypyc into build/native (luftpause/native.py),
# rebuilt when its sources change.  Without a C compiler it says so, the core runs
# interpreted, and the next make tries again.
CORE   := $(VENV)/.core
# luftpause/native.py's DEPENDS, and the build itself.
CORE_SOURCES := scheduler/_core.py scheduler/_persistent.py scheduler/_types.py luftpause/native.py

.PHONY: up test lint typecheck unit core clean

# A Python older than 3.11 is named before anything is built; a .venv an older one left
# (a first run before `PYTHON=python3.12`) is built again, as `venv` would keep its
# interpreter.
NEEDS_311 := import sys; sys.exit(sys.version_info < (3, 11))

$(STAMP): pyproject.toml
	@$(PYTHON) -c '$(NEEDS_311)' || { echo "luftpause needs Python 3.11 or later; '$(PYTHON)' is" \
		"$$($(PYTHON) --version 2>&1): run make with PYTHON=python3.12 (or another 3.11+)" >&2; exit 1; }
	@if [ -e $(BIN)/python ] && ! $(BIN)/python -c '$(NEEDS_311)' 2>/dev/null; then \
		echo "$(VENV) was built by a Python older than 3.11: building it again"; rm -rf $(VENV); fi
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The stamp is touched first: a source saved while the compiler runs is newer than it.
$(CORE): $(STAMP) $(CORE_SOURCES)
	touch $(CORE)
	$(BIN)/python -m luftpause.native || rm -f $(CORE)

core:
	rm -f $(CORE)
	$(MAKE) $(CORE)

# `make up ARGS="--port 8090"`: any flag of `luftpause up --help`.
up: $(CORE)
	$(BIN)/luftpause up $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy scheduler testkit/engine.py testkit/fake_engine.py testkit/loopback.py testkit/overhead.py testkit/bench_temporal.py testkit/bench_mcp.py testkit/bench.py testkit/load.py testkit/load_cli.py testkit/fanout.py testkit/bench_agents.py testkit/fake_dns.py testkit/trace.py luftpause/config.py luftpause/up.py luftpause/telemetry.py luftpause/temporal_dev.py luftpause/headers.py luftpause/native.py bench/core_compare.py setup.py gateway activities workflows worker

unit: $(CORE)
	$(BIN)/python -m pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) build scheduler/*.so
