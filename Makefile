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

$(STAMP): pyproject.toml
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
