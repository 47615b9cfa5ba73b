"""The load generator against a real fake engine, and `luftpause bench flood` end to end
(tiny, sped up): real proxies (luftpause's gateway, the SGLang router, SMG with its
priority scheduler and the engines registered), real HTTP."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fastapi import FastAPI, Request

from luftpause.headers import RUN_HEADER
from luftpause.up import Child
from scheduler import RunPhase
from testkit._fake_text import directives, key
from testkit.bench_agents import _Bed, _held_seconds, _references
from testkit.fake_engine import FakeEngineSettings, create_app
from testkit.load import CALL_FORMAT, LOOKUP_TOOL, Load, run_load, task_text
from testkit.loopback import serve
from tests.gateway.harness import endpoint, gateway, until

EXE = str(Path(sys.executable).parent / "luftpause")


def _bench_flood(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`luftpause bench flood ARGS` as its own process."""
    return subprocess.run(
        [EXE, "bench", "flood", *args], capture_output=True, text=True, timeout=timeout
    )


def _tiny_flood(
    arms: str, *, batch: int, interactive: int, minutes: float, time_scale: float, more: str
) -> subprocess.CompletedProcess[str]:
    """A flood small and fast enough for a test, as JSON (`more`: further flags)."""
    return _bench_flood(
        *f"--arms {arms} --batch {batch} --interactive {interactive} --minutes {minutes} "
        f"--time-scale {time_scale} --json {more}".split(),
        timeout=600,
    )


async def test_agents_run_closed_loops_of_the_engines_tool_calls() -> None:
    """Every counted run made as many turns as the fake engine plans tool calls for its
    own task (+1 for the answer) and ended inside the window; each class has its runs,
    and a growing conversation hits the cache."""
    load = Load(batch=2, interactive=1, context_chars=2000, tool_s=1.0, minutes=0.5, time_scale=20)
    settings = FakeEngineSettings(time_scale=20, max_tool_calls=3, seed=0)
    async with serve(create_app(settings)) as url:
        result = await run_load(load, url)
    assert result.errors == 0, result.first_errors
    assert result.count("interactive") >= 2 and result.count("batch") >= 4
    for r in result.runs:
        task, _ = directives(task_text(r.run_id, 2000))  # as the engine reads it
        plan = key(0, "tool-calls", task) % 4
        assert r.turns == plan + 1, r
        assert 0 < r.seconds <= r.ended <= 30.0
        assert r.run_id.startswith("i" if r.service_class == "interactive" else "b")
    assert len({r.run_id for r in result.runs}) == len(result.runs)
    assert sum(result.unfinished.values()) <= 3  # at most one run per agent was cut off
    assert 0 < result.cached_tokens < result.prompt_tokens


async def test_a_proxy_answering_200_without_a_completion_counts_as_errors() -> None:
    """A router's 200 that is no chat completion is an error the report names, never a
    run or a crash of the generator."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def odd() -> dict[str, Any]:
        return {"object": "error", "message": "upstream went away"}

    load = Load(batch=1, interactive=0, minutes=0.2, time_scale=20)
    async with serve(app) as url:
        result = await run_load(load, url)
    assert result.runs == [] and result.turns == 0
    assert result.errors >= 2
    assert "200 without a chat completion" in result.first_errors[0]
    assert "upstream went away" in result.first_errors[0]


def test_task_text_is_the_runs_own_and_sized() -> None:
    a, b = task_text("a1-r1", 8000), task_text("a1-r2", 8000)
    assert len(a) == len(b) == 8000
    assert a[:40] != b[:40] and a == task_text("a1-r1", 8000)


def test_bench_flood_compares_luftpause_with_the_sglang_router_and_smg() -> None:
    out = _tiny_flood(
        "luftpause,cache_aware,smg_priority",
        batch=4,
        interactive=2,
        minutes=0.5,
        time_scale=6,
        more="--context-chars 4000 --reference-arms luftpause",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert list(report["arms"]) == ["luftpause", "cache_aware", "smg_priority"]
    assert set(report["reference"]) == {"interactive-alone", "batch-alone"}
    ref_i = report["reference"]["interactive-alone"]
    ref_b = report["reference"]["batch-alone"]
    assert ref_i["batch_runs"] == 0 < ref_i["interactive_runs"]
    assert ref_b["interactive_runs"] == 0 < ref_b["batch_runs"]
    assert ref_i["arm"] == ref_b["arm"] == "luftpause"
    assert report["failed"] == {}
    assert "does not compare the proxies" in report["note"]  # time scale 6
    for name, arm in report["arms"].items():
        assert arm["errors"] == 0, (name, arm["first_errors"])
        assert set(arm["unfinished_runs"]) <= {"interactive", "batch"}
        assert arm["interactive_runs"] > 0 and arm["batch_runs"] > 0, name
        assert arm["P"] == round(
            arm["interactive_runs_per_min"] / ref_i["interactive_runs_per_min"], 3
        )
        assert arm["W"] == round(
            (arm["interactive_runs_per_min"] + arm["batch_runs_per_min"])
            / ref_b["batch_runs_per_min"],
            3,
        )
        assert arm["cached_prompt_token_share"] > 0, name
        # What each part needed of the CPUs while the agents ran (from /proc); a Rust
        # router under this light a load may need less than a clock tick (10 ms).
        cpu = arm["cpu_s"]
        assert cpu["proxy"] >= 0 and cpu["engines"] > 0, (name, cpu)
        assert cpu["proxy"] > 0 or name != "luftpause", cpu  # a Python gateway
        assert arm["cpu_s"]["load"] > 0, name
    # luftpause's own account of what it held: every admitted turn, by class.
    held = report["arms"]["luftpause"]["held"]
    assert set(held) == {"interactive", "batch"}
    assert (
        held["interactive"]["turns"] + held["batch"]["turns"]
        >= report["arms"]["luftpause"]["turns"]
        > 0
    )
    assert all(h["seconds"] >= 0 for h in held.values())
    assert "held" not in report["arms"]["cache_aware"]
    assert report["arms"]["luftpause"]["ratios"]["cache_aware"]["batch"] == round(
        report["arms"]["luftpause"]["batch_runs_per_min"]
        / report["arms"]["cache_aware"]["batch_runs_per_min"],
        3,
    )


def test_the_reference_is_the_better_one_class_run_of_each_class() -> None:
    results = {
        "interactive-alone/cache_aware": {"interactive_runs_per_min": 40.0},
        "interactive-alone/luftpause": {"interactive_runs_per_min": 46.0},
        "batch-alone/cache_aware": {"batch_runs_per_min": 182.0},
        "batch-alone/luftpause": {"batch_runs_per_min": 175.0},
        "luftpause": {"interactive_runs_per_min": 33.0, "batch_runs_per_min": 160.0},
    }
    ref = _references(results)
    assert ref["interactive-alone"]["arm"] == "luftpause"
    assert ref["interactive-alone"]["interactive_runs_per_min"] == 46.0
    assert ref["batch-alone"]["arm"] == "cache_aware"
    assert ref["batch-alone"]["each"] == {"cache_aware": 182.0, "luftpause": 175.0}
    assert _references({"luftpause": results["luftpause"]}) == {}


def test_an_arm_that_cannot_start_is_reported_with_its_logs() -> None:
    """A gateway that refuses its [policy] fails its arm: the report names it, keeps its
    logs (the gateway says what was wrong) and the command exits 1."""
    out = _tiny_flood(
        "luftpause", batch=1, interactive=1, minutes=0.1, time_scale=10, more="--policy kv_fill=7"
    )
    assert out.returncode == 1, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["luftpause_policy"] == ["kv_fill=7"]
    assert "exited during startup" in report["failed"]["luftpause"]
    # The reference runs keep the default policy: they ran, through luftpause too.
    assert set(report["failed"]) == {"luftpause"}
    assert report["reference"]["interactive-alone"]["each"].keys() == {"cache_aware", "luftpause"}
    logs = Path(report["arms"]["luftpause"]["logs"])
    try:
        assert "kv_fill" in (logs / "proxy.log").read_text()
    finally:
        shutil.rmtree(logs.parent, ignore_errors=True)


def test_bench_flood_rejects_an_arm_named_twice() -> None:
    out = _bench_flood("--arms", "luftpause,cache_aware,luftpause", timeout=60)
    assert out.returncode == 2 and "--arms names an arm twice" in out.stderr


def test_bench_flood_rejects_an_unknown_arm() -> None:
    out = _bench_flood("--arms", "luftpause,nginx", timeout=60)
    assert out.returncode == 2
    assert "unknown arm nginx" in out.stderr and "cache_aware" in out.stderr


def test_a_bed_part_that_died_during_the_load_is_named_with_its_signal(tmp_path: Path) -> None:
    # The gateway once died of SIGPIPE at the end of a load; the bench then said only
    # "Connection refused" when it asked for the gateway's metrics.
    def child(name: str, code: str, wait: bool = True) -> Child:
        c = Child(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")
        c.start()
        if wait:
            assert c.proc is not None
            c.proc.wait(timeout=30)
        return c

    proxy = child(
        "proxy",
        "import os, signal\n"
        "signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n"
        "os.kill(os.getpid(), signal.SIGPIPE)",
    )
    engine = child("engine0", "raise SystemExit(3)")
    with pytest.raises(RuntimeError) as dead:
        _Bed("http://127.0.0.1:9", proxy, [engine]).check_alive()
    assert str(dead.value) == (
        f"the proxy process exited by signal {int(signal.SIGPIPE)} during the load; "
        f"see {tmp_path / 'proxy.log'}"
    )
    running = child("proxy2", "import time; time.sleep(60)", wait=False)
    try:
        with pytest.raises(RuntimeError, match="the engine0 process exited with status 3"):
            _Bed("http://127.0.0.1:9", running, [engine]).check_alive()
    finally:
        running.stop()


def test_a_failed_metrics_scrape_is_reported_not_the_arm_lost() -> None:
    from luftpause.temporal_dev import free_port

    held = _held_seconds(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert set(held) == {"error"} and held["error"].startswith("/metrics: ")


def _written_call(body: dict[str, Any]) -> str:
    """What a model without a tool-call parser writes under the agent's `response_format`:
    a call of the offered tool as JSON text (checked against the schema asked for)."""
    schema = body["response_format"]["json_schema"]["schema"]
    call = {
        "name": schema["properties"]["name"]["const"],
        "arguments": {"query": schema["properties"]["arguments"]["properties"]["query"]["enum"][0]},
    }
    jsonschema.validate(call, schema)
    assert call["name"] in {t["function"]["name"] for t in body["tools"]}
    return json.dumps(call, indent=2)


def _scripted_engine(seen: dict[str, list[dict[str, Any]]]) -> FastAPI:
    """An engine that writes the call when asked for one ("stop"), else prose ("length")."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        # (luftpause does not pass its headers on: behind it, one list)
        seen.setdefault(request.headers.get(RUN_HEADER, ""), []).append(body)
        call = "response_format" in body
        text = _written_call(body) if call else f"reply {len(body['messages'])}"
        return {
            "choices": [
                {
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop" if call else "length",
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5},
        }

    return app


async def test_scripted_agents_have_the_model_write_their_tool_calls() -> None:
    """For a real model that makes no tool calls of its own: a run makes its own drawn
    number of calls (the same in every arm), each turn before the last asks for the call
    as JSON text, the last for prose of exact length, and the conversation grows by each
    call and result as a tool loop's would."""
    import random

    seen: dict[str, list[dict[str, Any]]] = {}
    load = Load(
        batch=2, interactive=1, context_chars=300, tool_s=1.0, tool_result_chars=120,
        minutes=0.3, time_scale=40, scripted_tools=True, max_tool_calls=3,
        tool_call_tokens=30, reply_tokens=11, seed=5, model="smol",
    )  # fmt: skip
    async with serve(_scripted_engine(seen)) as url:
        result = await run_load(load, url)
    assert result.errors == 0, result.first_errors
    assert result.count("interactive") >= 2 and result.count("batch") >= 4
    plans = set()
    for r in result.runs:
        k = random.Random(f"5/{r.run_id}").randrange(4)
        plans.add(k)
        bodies = seen[r.run_id]
        assert r.turns == len(bodies) == k + 1, r
        assert [b["max_tokens"] for b in bodies] == [30] * k + [11]
        assert [b.get("response_format") for b in bodies] == [CALL_FORMAT] * k + [None]
        assert [b.get("ignore_eos", False) for b in bodies] == [False] * k + [True]
        for n, b in enumerate(bodies):
            assert b["tools"] == [LOOKUP_TOOL] and b["temperature"] == 0
            assert b["model"] == "smol"
            msgs = b["messages"]
            assert [m["role"] for m in msgs] == ["user"] + ["assistant", "user"] * n
            assert msgs[0]["content"] == task_text(r.run_id, 300)
            # each call as written, then its result, as the next turn's new suffix
            if n:
                assert json.loads(msgs[-2]["content"])["name"] == "lookup"
                assert msgs[-1]["content"].startswith("Result of lookup: Task of run")
        # a prefix grows: every turn's conversation starts with the previous one's
        for a, b in itertools.pairwise(bodies):
            assert b["messages"][: len(a["messages"])] == a["messages"]
    assert len(plans) > 1  # the draw differs between runs


async def test_a_scripted_call_pauses_the_run_in_luftpause() -> None:
    """luftpause recovers the call the model wrote as text, so between a scripted run's
    turns the run is paused on a tool (it keeps its replica and, interactive, a slot), as
    with a model that calls tools; the run's last answer, prose, leaves it idle."""
    seen: dict[str, list[dict[str, Any]]] = {}
    load = Load(
        batch=0, interactive=2, context_chars=200, tool_s=1.5, tool_result_chars=80,
        minutes=0.1, scripted_tools=True, max_tool_calls=2, reply_tokens=8, seed=3,
    )  # fmt: skip
    async with (
        serve(_scripted_engine(seen)) as url,
        gateway(endpoint("e0", url)) as (gw, shell),
    ):
        base = str(gw.base_url).rstrip("/")
        agents = asyncio.create_task(run_load(load, base))
        paused = lambda: any(r.phase is RunPhase.PAUSED for r in shell.state.runs.values())  # noqa: E731
        await until(paused, "a run paused on the call its model wrote")
        result = await agents
        assert result.errors == 0, result.first_errors
        ended = [r.run_id for r in result.runs]
        assert ended and all(shell.state.runs[i].phase is RunPhase.IDLE for i in ended)


def test_bench_flood_on_llama_servers_asks_the_engines_for_their_slots(tmp_path: Path) -> None:
    """`--llama-server`: engines started with llama-server's flags, known to luftpause
    as `llamacpp` endpoints whose slots it reads from `/props` before the load starts,
    and the agents scripted.  The binary here is a stand-in that serves the fake
    engine's llama.cpp flavour with `--parallel` slots (llama-server is a 15-minute
    build; `bench/RESULTS.md` has the real one)."""
    argv_log = tmp_path / "argv.jsonl"
    shim = tmp_path / "llama-server"
    shim.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "a = sys.argv[1:]\n"
        "if a == ['--version']:\n"
        "    print('version: 1 (stand-in)'); sys.exit(0)\n"
        f"with open({str(argv_log)!r}, 'a') as f: f.write(json.dumps(a) + '\\n')\n"
        "v = lambda flag: a[a.index(flag) + 1]\n"
        f"os.execv({EXE!r}, [{EXE!r}, 'fake-engine', '--flavor', 'llamacpp', "
        "'--port', v('--port'), '--max-running', v('--parallel'), '--model', v('--alias')])\n"
    )
    shim.chmod(0o755)
    model = tmp_path / "Tiny-Model.Q4.gguf"
    model.write_bytes(b"GGUF")
    out = _bench_flood(
        *f"--arms luftpause --reference-arms luftpause --batch 3 --interactive 1 "
        f"--minutes 0.2 --engines 2 --slots 2,1 --context-per-slot 1024 --context-chars 1000 "
        f"--max-tool-calls 2 --tool-s 1 --reply-tokens 24 "
        f"--llama-server {shim} --llama-model {model} --json".split(),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["llama_server"] == {
        "model": "Tiny-Model.Q4.gguf",
        "slots": [2, 1],
        "threads_each": 1,
        "context_per_slot": 1024,
        "version": "version: 1 (stand-in)",
    }
    assert report["load"]["scripted_tools"] is True
    assert report["load"]["model"] == "Tiny-Model.Q4"
    arm = report["arms"]["luftpause"]
    assert arm["errors"] == 0, arm["first_errors"]
    assert arm["interactive_runs"] > 0 and arm["batch_runs"] > 0
    assert "P" in arm and "W" in arm
    assert arm["slots"] == {"e0": 2, "e1": 1}  # the gateway's, read from /props
    assert "llama.cpp servers" in report["note"]
    # three windows (the arm and two references), two engines each, llama-server's flags
    started = [json.loads(line) for line in argv_log.read_text().splitlines()]
    assert len(started) == 6
    for n, a in enumerate(started):
        slots = 2 if n % 2 == 0 else 1
        assert a[:4] == ["-m", str(model), "--alias", "Tiny-Model.Q4"]
        assert a[a.index("--parallel") + 1] == str(slots)
        assert a[a.index("-c") + 1] == str(slots * 1024)
        assert a[a.index("-t") + 1] == "1" and "--metrics" in a


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("", "--llama-server needs --llama-model GGUF"),
        ("--llama-model {model} --time-scale 4", "--time-scale must be 1"),
        ("--llama-model {model} --engines 2 --slots 2,2,2", "one per engine (2)"),
        ("--llama-model {model} --slots 0", "one count >= 1"),
        ("--llama-model {tmp}/none.gguf", "none.gguf: no such file"),
    ],
)
def test_bench_flood_refuses_real_engine_flags_that_do_not_fit(
    tmp_path: Path, flags: str, message: str
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\n")
    args = f"--llama-server {server} " + flags.format(model=model, tmp=tmp_path)
    out = _bench_flood(*args.split(), timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
