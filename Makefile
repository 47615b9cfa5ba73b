# The two commands the README promises. Both build .venv from nothing on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: up test lint typecheck unit clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# `make up ARGS="--port 8090"`: any flag of `luftpause up --help`.
up: $(STAMP)
	$(BIN)/luftpause up $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy scheduler testkit/engine.py testkit/fake_engine.py testkit/loopback.py testkit/overhead.py testkit/bench_temporal.py testkit/bench_mcp.py testkit/bench.py testkit/load.py testkit/load_cli.py testkit/fanout.py testkit/bench_agents.py testkit/fake_dns.py luftpause/config.py luftpause/up.py luftpause/telemetry.py luftpause/temporal_dev.py luftpause/headers.py gateway activities workflows worker

unit: $(STAMP)
	$(BIN)/python -m pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV)
