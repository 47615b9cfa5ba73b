"""`luftpause load`, the load generator's command, against a real gateway over loopback:
own-loop agents through the proxy (with the gateway's token, bounded by a run count) and
rounds of sub-agents over the MCP door (with Temporal and a worker)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request

from luftpause.headers import RUN_HEADER
from testkit.fake_engine import FakeEngineSettings, create_app
from testkit.fanout import Fanout, run_fanout
from testkit.loopback import serve
from tests.children import communicate
from tests.gateway.harness import closed_port_url, endpoint, gateway
from tests.workflows.harness import stack, task_with

EXE = str(Path(sys.executable).parent / "luftpause")


async def load(*args: str) -> tuple[int, str, str]:
    """`luftpause load ARGS` (the gateway it drives is served by this test's loop)."""
    proc = await asyncio.create_subprocess_exec(
        EXE, "load", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await communicate(proc, 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_own_loop_agents_through_the_gateway_until_a_run_count() -> None:
    engine = create_app(FakeEngineSettings(time_scale=20, max_tool_calls=3, seed=0))
    async with (
        serve(engine) as url,
        gateway(endpoint("e0", url), token="s3cret") as (client, _),
    ):
        gw = str(client.base_url).rstrip("/")
        args = ["--url", gw, "--batch", "2", "--interactive", "1", "--runs", "4"]
        args += ["--context-chars", "2000", "--tool-s", "0.05", "--minutes", "2"]
        code, out, err = await load(*args, "--token", "s3cret", "--json")
        assert code == 0, err
        result = json.loads(out)
        # Stopped at the count, well inside the window; the model was learned from the
        # gateway's /v1/models (with the token).
        assert result["interactive_runs"] + result["batch_runs"] == 4, result
        assert 0 < result["window_minutes"] < 2  # ended by the count
        assert "--runs 4 is under twice the agents" in err  # the sample leans short
        assert result["errors"] == 0 and result["turns"] >= 4
        assert result["cached_prompt_token_share"] > 0
        assert "llama-3.2-1b" in err  # the progress line names the model

        code, out, err = await load(*args, "--token", "wrong")
        assert code == 2 and "cannot learn the model" in err and "401" in err
        code, out, err = await load("--url", gw, "--runs", "0")
        assert code == 2 and "--runs must be at least 1" in err


async def test_agents_with_a_callers_own_token_name_that_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # helper-130: the agents named callers of their own (batch-job, user-N), which a
    # caller's own token refuses (403); --caller names the token's caller.
    monkeypatch.setenv("TEAM_A_TOKEN", "tok-a")
    sections = {"token": "op", "callers": [{"name": "team-a", "token_env": "TEAM_A_TOKEN"}]}
    engine = create_app(FakeEngineSettings(time_scale=20, max_tool_calls=1, seed=0))
    async with (
        serve(engine) as url,
        gateway(endpoint("e0", url), token="op", sections=sections) as (client, _),
    ):
        gw = str(client.base_url).rstrip("/")
        args = ["--url", gw, "--batch", "1", "--interactive", "1", "--runs", "2"]
        args += ["--context-chars", "500", "--tool-s", "0.05", "--token", "tok-a", "--json"]
        code, out, err = await load(*args, "--caller", "team-a")
        assert code == 0, err
        result = json.loads(out)
        assert result["errors"] == 0 and result["interactive_runs"] + result["batch_runs"] >= 2
        code, out, err = await load(*args, "--minutes", "0.05")  # their own names: refused
        assert json.loads(out)["errors"] > 0, out
        code, out, err = await load(*args, "--caller", "team a\n")
        assert code == 2 and "--caller: expected 1 to 128 printable ASCII" in err


async def test_rounds_of_sub_agents_over_mcp(temporal_address: str) -> None:
    async with stack(temporal_address) as s:
        plan = Fanout(fanout=4, rounds=2, task=task_with(1, "fan") + " {i}", tools=["lookup"])
        result = await run_fanout(plan, s.mcp_door)
        j = result.as_json()
        assert j["rounds"] == 2 and j["runs_by_state"] == {"Completed": 8}, j
        assert j["errors"] == 0 and not j["unfinished_round"]
        assert j["turns"] >= 8 and j["prompt_tokens"] > 0
        for r in result.rounds:
            assert 0 < r.slowest_s <= r.wall_s  # the round lasts as long as its slowest run

        # A round still going when the time is up: cut off, its runs cancelled.
        # (The same task for both: each makes 3 lookups, where "{i}" would change the plan.)
        slow = Fanout(fanout=2, minutes=0.05, task=task_with(3, "slow"), tools=["lookup"])
        s.mcp.gate.clear()  # lookups hold until the gate opens: the runs cannot end
        cut = await run_fanout(slow, s.mcp_door)
        s.mcp.gate.set()
        # (Reported apart, not a failure when rounds ended before it: a round --minutes
        # cuts off is the usual end; with none, nothing was measured.)
        assert cut.unfinished_round and cut.failed and not cut.rounds
        assert cut.cut_states == {"Running": 2} and cut.errors == 0
        every = [wf.id async for wf in s.client.list_workflows(f"TaskQueue = '{s.task_queue}'")]
        states = sorted(st.state for st in await s.runs.wait(every, timeout=30))
        assert states == ["Cancelled"] * 2 + ["Completed"] * 8, states

        # The command: one round, in a table.
        code, out, err = await load(
            "--url", s.gateway_url, "--subagents", "3", "--rounds", "1", "--task", "hi {i}"
        )
        assert code == 0, err
        assert "runs by state" in out and "Completed 3" in out, out
        # --max-tool-calls reaches the sub-agents: after one lookup each must answer
        # (two turns a run, where the task alone makes four).
        # (--tools lookup: offered every tool, a run may call one that waits for approval.)
        args = ["--url", s.gateway_url, "--subagents", "2", "--rounds", "1", "--json"]
        args += ["--tools", "lookup", "--task", task_with(3, "few")]
        code, out, err = await load(*args, "--max-tool-calls", "1")
        assert code == 0, err
        j = json.loads(out)
        assert j["runs_by_state"] == {"Completed": 2} and j["turns"] == 4, j


async def test_a_door_that_cannot_be_reached_is_one_line_and_exit_2() -> None:
    code, out, err = await load("--url", closed_port_url(), "--subagents", "2", "--rounds", "1")
    assert code == 2 and out == ""
    assert err.count("\n") <= 2 and "luftpause load: MCP door " in err, err
    code, out, err = await load("--subagents", "2", "--runs", "3")
    assert code == 2 and "not with --subagents" in err
    code, out, err = await load("--subagents", "2", "--scripted-tools")
    assert code == 2 and "--scripted-tools are for own-loop agents" in err


async def test_a_door_that_refuses_the_token_says_so() -> None:
    # helper-127: "MCPError: Server returned an error response", for a missing token.
    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b'{"error": {"message": "missing or wrong bearer token"}}'
        start = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 401, "headers": start})
        await send({"type": "http.response.body", "body": body})

    async with serve(refuse) as url:
        plan = Fanout(fanout=2, rounds=1, task="hi {i}")
        result = await run_fanout(plan, f"{url}/mcp")
        assert result.fatal == (
            f"MCP door {url}/mcp: 401 missing or wrong bearer token (the gateway's token: "
            "--token or $LUFTPAUSE_TOKEN)"
        )
        # With a token the gateway's own words (helper-130: a caller's token refused for
        # the caller header was said to be a wrong token).
        result = await run_fanout(plan, f"{url}/mcp", token="wrong")
        assert result.fatal == f"MCP door {url}/mcp: 401 missing or wrong bearer token"


async def test_scripted_tools_from_the_command_line() -> None:
    """`--scripted-tools` reaches the agents: the calls' turns ask for a call written as
    JSON, the last turn for prose, of the lengths asked; each call's result is the next
    turn's new message."""
    seen: dict[str, list[dict[str, Any]]] = {}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.setdefault(request.headers[RUN_HEADER], []).append(body)
        return {
            "choices": [{"message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": body["max_tokens"]},
        }

    async with serve(app) as url:
        args = ["--url", url, "--model", "smol", "--batch", "2", "--interactive", "0"]
        args += ["--runs", "6", "--tool-s", "0.01", "--context-chars", "200", "--json"]
        args += ["--scripted-tools", "--max-tool-calls", "2", "--tool-call-tokens", "5"]
        code, out, err = await load(*args, "--reply-tokens", "9")
        assert code == 0, err
        assert json.loads(out)["batch_runs"] >= 6
        code, _, err = await load(*args[:-4], "--max-tool-calls", "-1")
        assert code == 2 and "--max-tool-calls must be at least 0, got -1" in err
    lengths = set()
    for run in seen.values():
        # 0..2 calls, then the reply (a run the count cut short has no reply yet)
        asked = [b["max_tokens"] for b in run]
        calls = asked.count(5)
        assert calls <= 2 and asked == [5] * calls + [9] * (len(run) - calls), asked
        # the calls asked for as JSON text, the reply as prose of its exact length
        assert all(("response_format" in b) == (b["max_tokens"] == 5) for b in run)
        assert all(b.get("ignore_eos", False) == (b["max_tokens"] == 9) for b in run)
        if asked[-1] == 9:
            lengths.add(len(run))
        last = run[-1]["messages"]
        assert [m["role"] for m in last] == ["user"] + ["assistant", "user"] * (len(run) - 1)
        assert all(m["content"].startswith("Result of lookup: ") for m in last[2::2])
    assert len(lengths) > 1  # the runs that ended drew different numbers of calls


def test_a_cut_round_says_what_its_runs_were_waiting_for() -> None:
    # helper-135: up's banner ran every tool, delete_record asks for approval, nothing
    # approves it: no round ever ended, and the table said only "runs cancelled", rc 0.
    from testkit.fanout import FanoutResult
    from testkit.load_cli import _fanout_table

    cut = FanoutResult(fanout=4, unfinished_round=True)
    cut.cut_states = {"AwaitingApproval": 2, "Running": 2}
    table = _fanout_table(cut)
    assert cut.failed
    assert (
        "runs cancelled (they were AwaitingApproval 2, Running 2); a run awaiting approval "
        "waits for ever here: --tools without the tools that ask" in table
    )
    assert "no round ended within --minutes: nothing measured" in table
