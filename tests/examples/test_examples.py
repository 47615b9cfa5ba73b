"""The examples end to end: each agent, run through its command line entry point, against
the gateway (with a token) and two fake engines, over real loopback HTTP.

Every check can fail on a header the example forgot: the class is `batch`, and the caller
and run id are ours, none of them what the gateway assumes without the header.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from gateway._shell import AdmissionShell
from gateway.app import GatewaySettings, create_app
from luftpause.config import parse_config
from scheduler import Event, ServiceClass, TurnArrived
from testkit._fake_text import LONG_REPLY_TOKENS
from testkit.loopback import serve
from tests.workflows.harness import stack, task_with

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> ModuleType:
    """Import a file that is not in a package (the examples, the gateway tests' harness)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The module the gateway tests import as `harness` (their directory is on sys.path).
harness = _load("harness", ROOT / "tests" / "gateway" / "harness.py")

TOKEN = "sk-examples"
# The fake engine makes k = hash(first user message) % 4 tool calls in a run: 2 for this.
TASK = "Why does a paused run keep its replica?"
EXAMPLES = ["openai_loop", "agents_sdk", "langgraph_agent"]
ALL = [*EXAMPLES, "anthropic_loop", "mcp_subagents"]


@contextlib.asynccontextmanager
async def gateway(*endpoints: dict[str, Any]) -> AsyncIterator[tuple[str, Any, AdmissionShell]]:
    """The gateway with a token over loopback, recording what its clients send; yield its
    `/v1` URL, the recorder and the admission shell."""
    app = create_app(
        GatewaySettings(
            config=parse_config({"endpoints": list(endpoints)}), token=TOKEN, probe_period=0.05
        )
    )
    recorder = harness.Recorder(app)
    async with serve(recorder) as url:
        yield f"{url}/v1", recorder, app.state.shell


@pytest.mark.parametrize("name", EXAMPLES)
async def test_example_sends_the_three_headers_on_every_turn(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _load(name, ROOT / "examples" / f"{name}.py")
    run_id = f"{name}-run"
    caller = f"tests/examples/{name}"
    # The token comes from the environment, the rest from flags; no OpenAI key is needed.
    monkeypatch.setenv("LUFTPAUSE_TOKEN", TOKEN)
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2"):
        monkeypatch.delenv(var, raising=False)

    async with (
        harness.engine(instant=True) as (url_a, engine_a),
        harness.engine(instant=True) as (url_b, engine_b),
        gateway(harness.endpoint("a", url_a), harness.endpoint("b", url_b)) as (
            base_url,
            door,
            shell,
        ),
    ):
        arrived: list[TurnArrived] = []
        apply = shell.apply

        def spy(event: Event) -> None:
            if isinstance(event, TurnArrived):
                arrived.append(event)
            apply(event)

        monkeypatch.setattr(shell, "apply", spy)
        argv = [TASK, "--base-url", base_url, "--class", "batch", "--caller", caller]
        argv += ["--run-id", run_id]
        # main() runs an event loop of its own: give it a thread; the servers keep this one.
        assert await asyncio.to_thread(example.main, argv) == 0

        chats = engine_a.chats + engine_b.chats
        assert len(chats) >= 2
        # Every turn came to the gateway with the three headers and the token ...
        sent = {
            "x-luftpause-run-id": run_id,
            "x-luftpause-class": "batch",
            "x-luftpause-caller": caller,
            "authorization": f"Bearer {TOKEN}",
        }
        assert [{k: h.get(k) for k in sent} for h in door.headers] == [sent] * len(chats)
        # ... the admission shell saw each one under that run, class and caller (without
        # the headers: a run id of its own, interactive, anonymous) ...
        assert [(t.run_id, t.service_class, t.caller) for t in arrived] == [
            (run_id, ServiceClass.BATCH, caller)
        ] * len(chats)
        # ... and one engine (the run's) served them all, without our token.
        assert door.chats in (engine_a.chats, engine_b.chats)
        assert all("authorization" not in h for h in engine_a.headers + engine_b.headers)

        # Tool round trips: every turn after the first brings back more results of the
        # example's own tool.
        results = [[m for m in body["messages"] if m["role"] == "tool"] for body in door.chats]
        assert [len(r) for r in results] == sorted({len(r) for r in results})
        assert results[0] == [] and results[-1]
        assert all(m["content"].startswith("Notes on ") for m in results[-1])

        # The agent finished with the engine's answer to its last turn (the fake engine
        # answers the same conversation the same way: ask it again).
        url = url_a if door.chats[-1] in engine_a.chats else url_b
        async with httpx.AsyncClient(timeout=10) as client:
            reply = await client.post(f"{url}/v1/chat/completions", json=door.chats[-1])
        message: dict[str, Any] = reply.json()["choices"][0]["message"]
        assert not message.get("tool_calls") and message["content"]
        assert capsys.readouterr().out == f"{message['content']}\nrun id: {run_id}\n"

        # The example ended its run.
        await harness.until(
            lambda: not shell.state.turns and run_id not in shell.state.runs, "run ended"
        )


async def test_the_anthropic_example_runs_its_loop_on_the_messages_door(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _load("anthropic_loop", ROOT / "examples" / "anthropic_loop.py")
    caller, run_id = "tests/examples/anthropic_loop", "anthropic-run"
    monkeypatch.setenv("LUFTPAUSE_TOKEN", TOKEN)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    async with (
        harness.engine(instant=True) as (url_a, engine_a),
        harness.engine(instant=True) as (url_b, engine_b),
        gateway(harness.endpoint("a", url_a), harness.endpoint("b", url_b)) as (
            base_url,
            door,
            shell,
        ),
    ):
        argv = [TASK, "--base-url", base_url.removesuffix("/v1"), "--class", "batch"]
        argv += ["--caller", caller, "--run-id", run_id]
        assert await asyncio.to_thread(example.main, argv) == 0

        turns = [(h, body) for path, h, body in door.posts if path == "/v1/messages"]
        served = [p for p, _, _ in engine_a.posts + engine_b.posts]
        assert len(turns) >= 2 and served == ["/v1/messages"] * len(turns)
        # Every turn with the three headers, and the token (the SDK sends it as a bearer
        # token; its older releases, and Claude Code's ANTHROPIC_API_KEY, in x-api-key).
        sent = {
            "x-luftpause-run-id": run_id,
            "x-luftpause-class": "batch",
            "x-luftpause-caller": caller,
        }
        assert [{k: h.get(k) for k in sent} for h, _ in turns] == [sent] * len(turns)
        keys = {
            h.get("x-api-key") or h.get("authorization", "").removeprefix("Bearer ")
            for h, _ in turns
        }
        assert keys == {TOKEN}
        upstream = [h for _, h, _ in engine_a.posts + engine_b.posts]
        assert all("x-api-key" not in h and "authorization" not in h for h in upstream)
        # Tool round trips: the last turn brings back the example's own tool's results.
        last = turns[-1][1]["messages"]
        results = [b for m in last if isinstance(m["content"], list) for b in m["content"]]
        assert [b["content"][:9] for b in results if b["type"] == "tool_result"][-1] == "Notes on "
        out = capsys.readouterr().out
        assert out.endswith(f"run id: {run_id}\n") and len(out) > len(f"run id: {run_id}\n") + 1
        await harness.until(
            lambda: not shell.state.turns and run_id not in shell.state.runs, "run ended"
        )


async def test_the_mcp_example_spawns_two_runs_and_prints_their_answers_whole(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Against the real stack (Temporal, gateway, fake engines and tools, a worker), with
    # a token: the two runs are the example's caller's, and each answer it printed is the
    # run's whole answer, the long one's rest read with the `answer` tool.
    example = _load("mcp_subagents", ROOT / "examples" / "mcp_subagents.py")
    monkeypatch.setenv("LUFTPAUSE_TOKEN", TOKEN)
    async with stack(temporal_address, token=TOKEN) as s:
        argv = ["--url", s.mcp_door, "--caller", "tests/examples/mcp"]
        assert await asyncio.to_thread(example.main, argv) == 0
        out = capsys.readouterr().out
        tools, rest = out.split("\n", 1)
        assert tools.startswith("tools: ")
        assert {"spawn", "await", "answer"} <= set(tools.removeprefix("tools: ").split(", "))
        handles = re.findall(r"^(run-\S+) ", rest, re.MULTILINE)
        assert len(handles) == 2, out
        runs = await s.runs.statuses(handles)
        assert {r.caller for r in runs} == {"tests/examples/mcp"}
        printed = "".join(
            f"{r.handle} Completed, {r.usage.tool_calls} tool calls:\n{r.answer}\n" for r in runs
        )
        assert rest == printed
        # The first run used the tool it was given (examples/README.md: "its first run
        # asks for the fake MCP server's lookup"); helper-250 found its task made none.
        assert runs[0].usage.tool_calls >= 1, out
        # The long answer was longer than the await showed (maxChars 1000): its rest came
        # from `answer`.
        assert runs[1].answer is not None and len(runs[1].answer) == 4 * LONG_REPLY_TOKENS


async def test_the_mcp_example_says_why_a_run_ended_without_an_answer(
    temporal_address: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A run its budget stopped ends Cancelled with no answer: the example printed its
    # state and an empty answer, and the run's `error` (why) nowhere.
    example = _load("mcp_subagents", ROOT / "examples" / "mcp_subagents.py")
    monkeypatch.setattr(example, "TASKS", [{"task": "Look it up.", "tools": [], "budgetTokens": 1}])
    async with stack(temporal_address) as s:
        assert await asyncio.to_thread(example.main, ["--url", s.mcp_door]) == 0
        out = capsys.readouterr().out
        (handle,) = re.findall(r"^(run-\S+) ", out, re.MULTILINE)
        (run,) = await s.runs.statuses([handle])
        assert run.state == "Cancelled" and run.answer is None and run.error, run
        assert out.endswith(f"{handle} Cancelled, 0 tool calls:\nerror: {run.error}\n"), out


@pytest.mark.parametrize("approve_tool", [True, False])
async def test_the_mcp_example_stops_waiting_on_a_run_that_awaits_approval(
    temporal_address: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    approve_tool: bool,
) -> None:
    # helper-239: a run waiting for the user's approval moves only once someone answers;
    # the example's loop awaited it again and again (each `await` after the first holds
    # its 60 s timeout), so a user's copy with `approveTools` never ended.  It stops
    # waiting on that run, prints the rest, and says how to answer it.
    example = _load("mcp_subagents", ROOT / "examples" / "mcp_subagents.py")
    asking = {"task": task_with(1, "approve"), "tools": ["lookup"], "approveTools": ["lookup"]}
    monkeypatch.setattr(example, "TASKS", [asking, {"task": "Look it up.", "tools": []}])
    # (With `[mcp] approve_tool = false` it said to call `approve`, a tool not listed.)
    async with stack(temporal_address, mcp={"approve_tool": approve_tool}) as s:
        ran = asyncio.ensure_future(asyncio.to_thread(example.main, ["--url", s.mcp_door]))
        # Within the example's own await timeout (60 s): a loop that awaits the run again
        # takes longer.  Past it, the run is cancelled, which ends that loop too.
        finished, _ = await asyncio.wait([ran], timeout=45)
        out = capsys.readouterr().out
        handles = re.findall(r"^(run-\S+) ", out, re.MULTILINE)
        if not finished:
            waiting = await s.runs.list(state="AwaitingApproval")
            for handle in waiting:
                await s.runs.cancel(handle)
            await ran
            raise AssertionError(f"the example kept waiting on {waiting}")
        assert ran.result() == 0
        first, second = await s.runs.statuses(handles)
        assert first.state == "AwaitingApproval" and first.pending_approval is not None
        assert second.state == "Completed"
        pending = first.pending_approval
        assert f"{first.handle} AwaitingApproval, 0 tool calls:\n" in out
        how = (
            "answer it with the `approve` tool"
            if approve_tool
            else "they answer it in a client that shows forms (its `await` of the run asks them)"
        )
        assert (
            f"approval: {pending.tool} (callId {pending.call_id}) waits for the user: "
            f"{how}, or end the run with `cancel`\n"
        ) in out
        assert out.endswith(f"{second.handle} Completed, 0 tool calls:\n{second.answer}\n")
        await s.runs.cancel(first.handle)


@pytest.mark.parametrize("name", [*EXAMPLES, "anthropic_loop", "mcp_subagents"])
def test_an_example_takes_its_flags_under_python_oo(name: str) -> None:
    # helper-239: `python -OO` drops docstrings, and each example's main() split its
    # module's docstring for --help: AttributeError on None before any flag was read.
    # helper-249: langgraph_agent's @tool refused its tool without one, as it was
    # imported.  Run as a user runs it, under -OO itself.
    done = subprocess.run(
        [sys.executable, "-OO", str(ROOT / "examples" / f"{name}.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ")


def _closed_port() -> int:
    """A loopback port nothing listens on (bound once, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _url_flags(name: str, root: str) -> list[str]:
    """The flags that point an example at a gateway whose root URL is `root`."""
    if name == "mcp_subagents":
        return ["--url", f"{root}/mcp"]
    return ["--base-url", root if name == "anthropic_loop" else f"{root}/v1"]


@pytest.mark.parametrize("name", ALL)
def test_an_example_with_no_gateway_there_says_so_in_a_line(name: str) -> None:
    # helper-250: against a closed port each example printed a 40-100 line traceback.
    # Now one line naming the URL, and a non-zero exit, from its command line.
    flags = _url_flags(name, f"http://127.0.0.1:{_closed_port()}")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{name}.py"), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("LUFTPAUSE_")},
    )
    assert done.returncode != 0 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"{flags[1]}: ") and "Is the gateway running there?" in line, line


@pytest.mark.parametrize("name", ALL)
async def test_an_example_refused_for_its_token_says_how_to_give_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # helper-250: a 401 was a traceback too, over MCP one that said only "Server
    # returned an error response".
    example = _load(name, ROOT / "examples" / f"{name}.py")
    monkeypatch.setenv("LUFTPAUSE_TOKEN", "not-the-token")
    async with (
        harness.engine(instant=True) as (url, _),
        gateway(harness.endpoint("a", url)) as (
            base_url,
            _,
            _,
        ),
    ):
        flags = _url_flags(name, base_url.removesuffix("/v1"))
        with pytest.raises(SystemExit) as done:
            await asyncio.to_thread(example.main, flags)
    said = str(done.value.code)
    assert said.startswith(f"{flags[1]}: ") and "401" in said and "\n" not in said, said
    assert said.endswith("Give the gateway's token: --token or LUFTPAUSE_TOKEN"), said


def test_the_agents_sdk_example_describes_its_tool_under_python_oo() -> None:
    # helper-250: the SDK's @function_tool read the tool's and its parameter's
    # descriptions from the docstring, which `python -OO` drops: the model got the tool
    # with no description, silently.  The Chat Completions tool the SDK sends, built
    # under -OO (its own process: the flag is the interpreter's).
    script = (
        "import importlib.util, json, sys\n"
        "from agents.models.chatcmpl_converter import Converter\n"
        "spec = importlib.util.spec_from_file_location('agents_sdk', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print(json.dumps(Converter.tool_to_openai(module.lookup)))\n"
    )
    path = str(ROOT / "examples" / "agents_sdk.py")
    done = subprocess.run(
        [sys.executable, "-OO", "-c", script, path],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    function = json.loads(done.stdout)["function"]
    assert function["name"] == "lookup"
    assert function["description"] == "Look something up in the team notes."
    assert function["parameters"]["properties"]["query"]["description"] == "what to look up"


def test_the_anthropic_example_takes_the_other_examples_base_url() -> None:
    # helper-135: examples/README.md says every example's --base-url defaults from
    # LUFTPAUSE_BASE_URL; this one read only its own variable and went to :8080.
    example = _load("anthropic_loop", ROOT / "examples" / "anthropic_loop.py")
    base = example._base_url
    assert base({"LUFTPAUSE_BASE_URL": "http://h:9/v1"}) == "http://h:9"
    assert base({"LUFTPAUSE_BASE_URL": "http://h:9/v1/"}) == "http://h:9"
    both = {"LUFTPAUSE_BASE_URL": "http://h:9/v1", "LUFTPAUSE_ANTHROPIC_BASE_URL": "http://a:1"}
    assert base(both) == "http://a:1"
    assert base({}) == "http://127.0.0.1:8080"
