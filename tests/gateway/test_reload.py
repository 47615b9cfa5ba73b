"""Changing the pool without a restart: `POST /reload` (and SIGHUP, tested on the
process in tests/luftpause/test_cli.py) over a real gateway and fake engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import MODEL, RUN, answered_health, closed_port_url, engine, gateway, until
from starlette.types import Receive, Scope, Send

from gateway._shell import AdmissionShell
from gateway.app import GatewaySettings, create_app
from gateway.pool import compare
from luftpause.config import Config, ConfigError, load_config
from scheduler import RunPhase
from testkit._fake_text import key
from testkit.loopback import serve

OTHER = "other-model"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "look something up",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def toml(*endpoints: dict[str, Any], extra: str = "") -> str:
    out = []
    for e in endpoints:
        models = ", ".join(f'"{m}"' for m in e["models"])
        out.append(
            f'[[endpoints]]\nname = "{e["name"]}"\nurl = "{e["url"]}"\n'
            f'kind = "{e.get("kind", "sglang")}"\nmodels = [{models}]\n'
            + "".join(
                f"{k} = {v}\n" for k, v in e.items() if k not in ("name", "url", "models", "kind")
            )
        )
    return "\n".join(out) + extra


@contextlib.asynccontextmanager
async def from_file(
    path: Path, probe_period: float | None = 0.05
) -> AsyncIterator[tuple[httpx.AsyncClient, AdmissionShell]]:
    """A gateway started from a configuration file, as `luftpause gateway --config`
    (`probe_period` None: the file's)."""
    settings = GatewaySettings(
        config=load_config(path), probe_period=probe_period, config_path=str(path)
    )
    app = create_app(settings)
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield client, app.state.shell


# A reply that streams for seconds from an engine at time_scale 0.5.
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "a long story"}],
    "stream": True,
    "max_tokens": 256,
}


@contextlib.asynccontextmanager
async def one_streaming_one_held(
    gw: httpx.AsyncClient, shell: AdmissionShell
) -> AsyncIterator[tuple[AsyncIterator[str], asyncio.Future[httpx.Response]]]:
    """A long reply streaming from replica a, whose KV pool (kv_tokens = 400) fits one
    new run at a time, and a second turn luftpause holds meanwhile: the first's lines
    to come, and the second's answer to come."""
    async with gw.stream("POST", "/v1/chat/completions", json=LONG) as first:
        lines = first.aiter_lines()  # kept: a dropped iterator closes the stream
        await anext(lines)
        second = asyncio.ensure_future(
            gw.post("/v1/chat/completions", json={**LONG, "stream": False})
        )
        await until(lambda: shell.state.held_count() == 1, "the second turn held")
        yield lines, second


def calling_task() -> str:
    """A first user message for which the fake engine answers with a tool call."""
    return next(f"task {i}" for i in range(1000) if key(0, "tool-calls", f"task {i}") % 4 >= 1)


async def chat(gw: httpx.AsyncClient, run: str, messages: list[Any], model: str = MODEL) -> Any:
    body = {"model": model, "messages": messages, "tools": TOOLS, "fake_max_tool_calls": 3}
    r = await gw.post("/v1/chat/completions", json=body, headers={RUN: run})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def chat_body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def models(gw: httpx.AsyncClient) -> list[str]:
    r = await gw.get("/v1/models")
    return [m["id"] for m in r.json()["data"]]


async def test_a_reload_adds_and_removes_replicas_and_a_paused_run_moves(
    tmp_path: Path,
) -> None:
    async with engine() as (url_a, rec_a), engine(models=(MODEL, OTHER)) as (url_b, rec_b):
        path = tmp_path / "luftpause.toml"
        path.write_text(toml({"name": "a", "url": url_a, "models": [MODEL]}))
        async with from_file(path) as (gw, shell):
            messages: list[Any] = [{"role": "user", "content": calling_task()}]
            choice = await chat(gw, "r1", messages)
            assert choice["finish_reason"] == "tool_calls"
            assert shell.state.runs["r1"].phase is RunPhase.PAUSED
            assert len(rec_a.chats) == 1 and shell.state.runs["r1"].replica == "a"

            path.write_text(toml({"name": "b", "url": url_b, "models": [MODEL, OTHER]}))
            r = await gw.post("/reload")
            assert r.status_code == 200, r.text
            assert r.json() == {
                "added": ["b"],
                "removed": ["a"],
                "changed": [],
                "applied": [],
                "not_applied": [],
            }
            assert await models(gw) == [MODEL, OTHER]
            # a is out of rotation, kept while the paused run is bound to it
            a = shell.state.replicas["a"]
            assert "a" in shell.state.retired and not a.healthy and a.bound_runs == 1
            status = (await gw.get("/status")).json()
            assert [(x["name"], x["retired"]) for x in status["replicas"]] == [
                ("a", True),
                ("b", False),
            ]
            # Unprobed since it left: no engine load shown for it (helper-146: its last
            # reading stood until the run bound to it expired).
            assert a.queued is not None and a.running is not None  # what the core keeps
            shown = {x["name"]: x for x in status["replicas"]}
            assert shown["a"]["engine_queued"] is shown["a"]["engine_running"] is None
            assert shown["b"]["engine_running"] is not None
            metrics = (await gw.get("/metrics")).text
            assert 'luftpause_engine_running{replica="a"}' not in metrics
            assert 'luftpause_engine_running{replica="b"}' in metrics
            assert 'luftpause_replica_retired{replica="a"} 1.0' in metrics

            # The run's next turn goes to b; then nothing is bound to a, which is forgotten.
            messages.append(choice["message"])
            for call in choice["message"]["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "x"})
            await chat(gw, "r1", messages)
            assert (len(rec_a.chats), len(rec_b.chats)) == (1, 1)
            assert "a" not in shell.state.replicas
            status = (await gw.get("/status")).json()
            assert [x["name"] for x in status["replicas"]] == ["b"]
            # the model b brought is served
            await chat(gw, "r2", [{"role": "user", "content": "hello"}], model=OTHER)
            assert rec_b.chats[-1]["model"] == OTHER


async def test_a_turn_streaming_from_a_removed_replica_finishes_there(tmp_path: Path) -> None:
    # time_scale 0.5: a 256-token reply streams for seconds, long enough to reload meanwhile
    async with engine(time_scale=0.5) as (url_a, rec_a), engine() as (url_b, rec_b):
        path = tmp_path / "luftpause.toml"
        path.write_text(toml({"name": "a", "url": url_a, "models": [MODEL]}))
        async with from_file(path) as (gw, shell):
            events = []
            async with gw.stream("POST", "/v1/chat/completions", json=LONG) as r:
                lines = r.aiter_lines()
                events.append(await anext(lines))  # the engine is answering
                path.write_text(toml({"name": "b", "url": url_b, "models": [MODEL]}))
                reload = await gw.post("/reload")
                assert reload.json()["removed"] == ["a"]
                assert shell.state.replicas["a"].in_flight == 1
                # a new turn goes to b meanwhile
                await chat(gw, "r2", [{"role": "user", "content": "hello"}])
                assert len(rec_b.chats) == 1
                events += [line async for line in lines]
            assert r.status_code == 200
            assert [e for e in events if e.startswith("data:")][-1] == "data: [DONE]"
            assert len(rec_a.chats) == 1
            assert "a" not in shell.state.replicas, "forgotten once its last turn ended"


async def test_a_reload_that_cannot_apply_changes_nothing(tmp_path: Path) -> None:
    async with engine() as (url_a, rec_a):
        path = tmp_path / "luftpause.toml"
        good = toml({"name": "a", "url": url_a, "models": [MODEL]})
        path.write_text(good)
        async with from_file(path) as (gw, shell):
            before = {n: r.spec for n, r in shell.state.replicas.items()}

            path.write_text(good + "\n[[endpoints]\n")
            r = await gw.post("/reload")
            assert r.status_code == 400
            assert "not valid TOML" in r.json()["error"]["message"]
            assert str(path) in r.json()["error"]["message"]

            # the same name for another engine: refused, naming what changed
            moved = toml({"name": "a", "url": "http://127.0.0.1:9", "models": [MODEL, OTHER]})
            path.write_text(moved)
            r = await gw.post("/reload")
            assert r.status_code == 400
            message = r.json()["error"]["message"]
            assert "nothing was reloaded" in message and "endpoint a: url" in message

            assert {n: r.spec for n, r in shell.state.replicas.items()} == before
            assert await models(gw) == [MODEL]
            await chat(gw, "r1", [{"role": "user", "content": "hello"}])
            assert len(rec_a.chats) == 1


async def test_policy_probes_and_session_runs_apply_and_others_are_named_and_left(
    tmp_path: Path,
) -> None:
    async with engine() as (url_a, _):
        path = tmp_path / "luftpause.toml"
        a = {"name": "a", "url": url_a, "models": [MODEL]}
        down = {"name": "down", "url": closed_port_url(), "models": [OTHER]}
        path.write_text(toml(a, down, extra="\n[probes]\nperiod_s = 0.05\n"))
        async with from_file(path, probe_period=None) as (gw, shell):
            r = await gw.post("/v1/chat/completions", json=chat_body(OTHER))
            assert r.status_code == 503 and r.headers["retry-after"] == "1"

            session = {"x-claude-code-session-id": "s1"}
            r = await gw.post("/v1/chat/completions", json=chat_body(MODEL), headers=session)
            assert r.headers[RUN] == "claude-code:s1"
            path.write_text(
                "session_runs = false\n"
                + toml(
                    {**a, "models": [MODEL, OTHER]},
                    down,
                    extra="\n[policy]\nmax_held_per_caller = 3\n\n[probes]\nperiod_s = 3.0\n"
                    '\n[temporal]\nnamespace = "elsewhere"\n'
                    # The MCP door is made at start: its tools are listed as they were.
                    "\n[mcp]\napprove_tool = false\n",
                )
            )
            r = await gw.post("/reload")
            assert r.json() == {
                "added": [],
                "removed": [],
                "changed": ["a"],
                "applied": ["policy", "probes", "session_runs"],
                "not_applied": ["mcp", "temporal"],
            }
            assert shell.state.policy.max_held_per_caller == 3  # [policy]: in the core
            assert shell.state.replicas["a"].spec.models == {MODEL, OTHER}
            assert await models(gw) == [MODEL, OTHER]
            r = await gw.post("/v1/chat/completions", json=chat_body(MODEL), headers=session)
            assert r.headers[RUN] != "claude-code:s1"  # session headers are not read now
            path.write_text(toml(a, down, extra="\n[probes]\nperiod_s = 3.0\n"))
            r = await gw.post("/reload")
            assert r.json()["applied"] == ["policy", "session_runs"]
            # [temporal] is back as the gateway started with it: nothing waits for a restart.
            assert r.json()["not_applied"] == []
            assert r.json()["removed"] == []
            assert shell.state.policy.max_held_per_caller is None  # back to the default
            r = await gw.post("/v1/chat/completions", json=chat_body(OTHER))
            # [probes]: a turn refused for want of a healthy replica looks again after
            # the next round, 3 s from now.
            assert r.status_code == 503 and r.headers["retry-after"] == "3"


async def test_reload_needs_the_token_and_a_file() -> None:
    async with engine() as (url, _):
        ep = {"name": "a", "url": url, "kind": "sglang", "models": [MODEL]}
        async with gateway(ep, token="secret") as (gw, _):
            r = await gw.post("/reload")
            assert r.status_code == 401
            r = await gw.post("/reload", headers={"authorization": "Bearer secret"})
            assert r.status_code == 400
            assert "not started from a configuration file" in r.json()["error"]["message"]


async def test_a_held_turn_goes_to_a_replica_that_joins_while_it_waits(tmp_path: Path) -> None:
    async with engine(time_scale=0.5) as (url_a, rec_a), engine() as (url_b, rec_b):
        path = tmp_path / "luftpause.toml"
        a = {"name": "a", "url": url_a, "models": [MODEL], "kv_tokens": 400}
        path.write_text(toml(a))
        async with (
            from_file(path) as (gw, shell),
            one_streaming_one_held(gw, shell) as (lines, second),
        ):
            path.write_text(toml(a, {"name": "b", "url": url_b, "models": [MODEL]}))
            r = await gw.post("/reload")
            assert r.json()["added"] == ["b"]
            assert (await second).status_code == 200
            assert (len(rec_a.chats), len(rec_b.chats)) == (1, 1)

            # a, retired while its stream runs, may not come back as another engine
            path.write_text(toml({"name": "b", "url": url_b, "models": [MODEL]}))
            assert (await gw.post("/reload")).json()["removed"] == ["a"]
            path.write_text(
                toml({**a, "url": url_b}, {"name": "b", "url": url_b, "models": [MODEL]})
            )
            r = await gw.post("/reload")
            assert r.status_code == 400 and "endpoint a: url" in r.json()["error"]["message"]
            assert "a" in shell.state.retired and "a" in shell.state.replicas
            assert [line async for line in lines][-2:] == ["data: [DONE]", ""]


async def test_a_kv_pool_the_file_stops_giving_is_the_engines_again(tmp_path: Path) -> None:
    # A reload that took kv_tokens out said "changed" and kept the file's number until
    # a restart: the engine, asked again, was not believed while the replica had one.
    async with engine() as (url_a, _):
        path = tmp_path / "luftpause.toml"
        a = {"name": "a", "url": url_a, "models": [MODEL]}
        path.write_text(toml(a))
        async with from_file(path) as (gw, shell):
            reported = shell.state.replicas["a"].spec.kv_tokens
            assert reported is not None and reported != 1000  # the fake engine's own
            path.write_text(toml({**a, "kv_tokens": 1000}))
            assert (await gw.post("/reload")).json()["changed"] == ["a"]
            assert shell.state.replicas["a"].spec.kv_tokens == 1000
            path.write_text(toml(a))
            assert (await gw.post("/reload")).json()["changed"] == ["a"]
            await until(lambda: shell.state.replicas["a"].spec.kv_tokens == reported, "asked again")


async def test_a_reload_warns_of_a_key_it_brings_that_is_not_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As the start does: an endpoint the reload adds whose api_key_env is unset goes
    # without a key (a hosted endpoint then fails every probe); a warning says why.
    monkeypatch.delenv("NEW_KEY", raising=False)
    async with engine() as (url_a, _), engine() as (url_b, _):
        path = tmp_path / "luftpause.toml"
        a = {"name": "a", "url": url_a, "models": [MODEL]}
        path.write_text(toml(a))
        async with from_file(path) as (gw, _):
            path.write_text(toml(a, {"name": "b", "url": url_b, "models": [MODEL],
                                     "api_key_env": '"NEW_KEY"'}))  # fmt: skip
            with caplog.at_level("WARNING"):
                assert (await gw.post("/reload")).json()["added"] == ["b"]
                await gw.post("/reload")  # nothing new: said once
            said = [r.getMessage() for r in caplog.records if "NEW_KEY" in r.getMessage()]
            assert said == [
                "endpoint b: api_key_env = 'NEW_KEY', but NEW_KEY is not set: its requests "
                "go without a key"
            ]
            # ... and an endpoint at a URL another has (one engine counted twice)
            path.write_text(toml(a, {"name": "c", "url": url_a, "models": [MODEL]}))
            with caplog.at_level("WARNING"):
                assert (await gw.post("/reload")).json()["added"] == ["c"]
            shared = [r.getMessage() for r in caplog.records if "same url" in r.getMessage()]
            assert shared == [
                f"endpoints a, c have the same url {url_a}: one engine counted as several "
                "replicas (its slots and KV pool each time); give it one endpoint with all "
                "its models"
            ]


async def test_a_name_freed_by_the_core_takes_another_engine(tmp_path: Path) -> None:
    # Removed while a run is paused there, a replica stays known (its run may come
    # back to it); once the run ends the core forgets it, and so does the reload's
    # check: the name may serve another engine.  (It was refused until some other
    # reload had run.)
    async with engine() as (url_a, _), engine() as (url_b, _), engine() as (url_c, rec_c):
        path = tmp_path / "luftpause.toml"
        urls = {"a": url_a, "b": url_b}
        path.write_text(toml(*({"name": n, "url": u, "models": [MODEL]} for n, u in urls.items())))
        async with from_file(path) as (gw, shell):
            choice = await chat(gw, "r1", [{"role": "user", "content": calling_task()}])
            assert choice["finish_reason"] == "tool_calls"
            home = shell.state.runs["r1"].replica
            assert home is not None
            other = "b" if home == "a" else "a"
            kept = {"name": other, "url": urls[other], "models": [MODEL]}
            path.write_text(toml(kept))
            assert (await gw.post("/reload")).json()["removed"] == [home]
            assert home in shell.state.retired
            assert (await gw.delete("/v1/runs/r1")).status_code == 204
            assert home not in shell.state.replicas  # forgotten with its last run
            path.write_text(toml({"name": home, "url": url_c, "models": [MODEL]}))
            r = await gw.post("/reload")
            assert r.status_code == 200, r.text
            assert (r.json()["added"], r.json()["removed"]) == ([home], [other])
            await chat(gw, "r2", [{"role": "user", "content": "hello"}])
            assert len(rec_c.chats) == 1  # the new engine, under the old name


async def test_an_idle_runs_forgotten_replica_is_not_named(tmp_path: Path) -> None:
    # An idle run binds nothing: its replica, removed, is forgotten at once, and the run
    # may go anywhere next.  /v1/runs does not name it as if it were still there.
    async with engine() as (url_a, _), engine() as (url_b, _):
        path = tmp_path / "luftpause.toml"
        urls = {"a": url_a, "b": url_b}
        path.write_text(toml(*({"name": n, "url": u, "models": [MODEL]} for n, u in urls.items())))
        async with from_file(path) as (gw, shell):
            choice = await chat(gw, "r1", [{"role": "user", "content": "hello"}])
            assert choice["finish_reason"] == "stop"
            home = shell.state.runs["r1"].replica
            assert home is not None and shell.state.runs["r1"].phase.value == "idle"
            assert (await gw.get("/v1/runs/r1")).json()["replica"] == home
            other = "b" if home == "a" else "a"
            path.write_text(toml({"name": other, "url": urls[other], "models": [MODEL]}))
            assert (await gw.post("/reload")).json()["removed"] == [home]
            assert home not in shell.state.replicas
            assert (await gw.get("/v1/runs/r1")).json()["replica"] is None
            (listed,) = (await gw.get("/v1/runs")).json()["runs"]
            assert listed["run_id"] == "r1" and listed["replica"] is None
            await chat(gw, "r1", [{"role": "user", "content": "hello again"}])
            assert (await gw.get("/v1/runs/r1")).json()["replica"] == other


async def test_a_held_turn_whose_model_leaves_the_pool_is_answered_404(tmp_path: Path) -> None:
    # a's KV pool (400 tokens) fits one new run at a time: while the first streams, the
    # second is held by luftpause.  Then a leaves, and its model with it.
    async with engine(time_scale=0.5) as (url_a, _), engine(models=(OTHER,)) as (url_b, _):
        path = tmp_path / "luftpause.toml"
        path.write_text(toml({"name": "a", "url": url_a, "models": [MODEL], "kv_tokens": 400}))
        async with (
            from_file(path) as (gw, shell),
            one_streaming_one_held(gw, shell) as (lines, second),
        ):
            path.write_text(toml({"name": "b", "url": url_b, "models": [OTHER]}))
            assert (await gw.post("/reload")).status_code == 200
            r = await second
            assert r.status_code == 404
            message = r.json()["error"]["message"]
            assert f"model '{MODEL}'" in message and "left the pool while" in message
            assert f"served: {OTHER}" in message
            assert r.headers[RUN]
            metrics = (await gw.get("/metrics")).text
            assert 'luftpause_held_unadmitted_seconds_count{class="interactive"} 1.0' in metrics
            assert [line async for line in lines][-2:] == ["data: [DONE]", ""]


@pytest.mark.parametrize(("before", "after"), [(600, 2), (2, 600)])
async def test_a_turn_held_across_a_reload_waits_for_its_engine_the_new_turn_timeout(
    tmp_path: Path, before: int, after: int
) -> None:
    """The proxy read `turn_timeout_s` as the turn arrived (helper-151).  Lowered while
    the turn was held, the core freed its slot at the new limit while the proxy waited
    on for the old one (the client unanswered, the next turn sent into a busy engine);
    raised, the turn was given up at the old limit.  The engine wait of a turn admitted
    after the reload is bounded by the new one."""
    release = asyncio.Event()
    answer_after = {"first": 0.0, "second": 4.0}  # past 2 s, well within 600 s
    gave_up: list[str] = []

    async def engine_app(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        which = json.loads(body)["messages"][0]["content"]
        if which == "first":
            await release.wait()
        try:
            async with asyncio.timeout(answer_after[which]):
                while (await receive())["type"] != "http.disconnect":
                    pass
            gave_up.append(which)  # the gateway closed the request before the answer
            return
        except TimeoutError:
            pass
        said = {"role": "assistant", "content": which}
        answer = {"choices": [{"index": 0, "message": said, "finish_reason": "stop"}]}
        head = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    async with serve(engine_app) as url:
        path = tmp_path / "luftpause.toml"
        endpoint = {"name": "a", "url": url, "models": [MODEL], "kind": "openai", "slots": 1}
        path.write_text(toml(endpoint, extra=f"\n[policy]\nturn_timeout_s = {before}\n"))
        async with from_file(path) as (gw, shell):

            def ask(which: str) -> asyncio.Future[httpx.Response]:
                body = {"model": MODEL, "messages": [{"role": "user", "content": which}]}
                return asyncio.ensure_future(gw.post("/v1/chat/completions", json=body))

            first = ask("first")
            await until(lambda: shell.state.replicas["a"].in_flight == 1, "the first admitted")
            second = ask("second")
            await until(lambda: shell.state.held_count() == 1, "the second held")
            path.write_text(toml(endpoint, extra=f"\n[policy]\nturn_timeout_s = {after}\n"))
            assert (await gw.post("/reload")).json()["applied"] == ["policy"]
            release.set()
            assert (await first).status_code == 200
            r = await asyncio.wait_for(second, 20)  # (600 s on the old code, when lowered)
            if after < before:
                assert r.status_code == 504, r.text
                assert "no answer within 2 s" in r.json()["error"]["message"]
                assert gave_up == ["second"]
            else:
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == "second"
                assert gave_up == []
            await until(lambda: not shell.state.turns, "both turns ended")
            assert shell.state.replicas["a"].in_flight == 0


async def test_a_held_turn_admitted_to_a_replica_without_its_api_is_answered_404(
    tmp_path: Path,
) -> None:
    """A Messages turn held while a reload adds a replica of its model that does not
    take the Messages API: the core places turns by model, and the held turn went
    there, its engine's 404 passed on (helper-143).  It is refused as a turn arriving
    now is, in the Anthropic shape, nothing sent to b, and not b's fault."""
    async with engine(time_scale=0.5) as (url_a, rec_a), engine() as (url_b, rec_b):
        path = tmp_path / "luftpause.toml"
        a = {"name": "a", "url": url_a, "models": [MODEL], "slots": 1}
        path.write_text(toml(a))
        async with from_file(path) as (gw, shell):
            async with gw.stream("POST", "/v1/chat/completions", json=LONG) as first:
                lines = first.aiter_lines()
                await anext(lines)
                hi = [{"role": "user", "content": "hi"}]
                msg = {"model": MODEL, "max_tokens": 8, "messages": hi}
                held = asyncio.ensure_future(gw.post("/v1/messages", json=msg))
                await until(lambda: shell.state.held_count() == 1, "the Messages turn held")
                b = {"name": "b", "url": url_b, "models": [MODEL], "messages": "false"}
                path.write_text(toml(a, b))
                assert (await gw.post("/reload")).json()["added"] == ["b"]
                r = await held
                assert r.status_code == 404, r.text
                assert r.json()["type"] == "error"
                message = r.json()["error"]["message"]
                assert "is served by replicas that do not take the Anthropic " in message
                assert "(b: messages = false" in message
                assert r.headers[RUN]
                # A new one is refused alike, before it is held.
                fresh = await gw.post("/v1/messages", json=msg)
                assert fresh.status_code == 404 and "(b: messages = false" in fresh.text
                assert [line async for line in lines][-2:] == ["data: [DONE]", ""]
            assert rec_b.posts == [] and len(rec_a.posts) == 1
            assert not shell.state.turns and shell.state.replicas["b"].failures == 0


async def test_a_classifier_added_by_a_reload_answers_decide(tmp_path: Path) -> None:
    clf = "clf-model"
    async with engine() as (url_a, _), engine(models=(clf,), instant=True) as (url_c, rec_c):
        path = tmp_path / "luftpause.toml"
        a = {"name": "a", "url": url_a, "models": [MODEL]}
        path.write_text(toml(a))
        async with from_file(path) as (gw, shell):
            before = await gw.post("/v1/decide", json={"input": "a lovely day"})
            assert before.status_code == 404
            assert before.json()["error"]["message"] == "no classifier endpoint is configured"
            c = {"name": "c", "url": url_c, "models": [clf], "kind": "classifier"}
            path.write_text(toml(a, {**c, "labels": ["negative", "positive"]}))
            r = await gw.post("/reload")
            assert r.json() == {
                "added": ["c"],
                "removed": [],
                "changed": [],
                "applied": [],
                "not_applied": [],
            }
            after = await gw.post("/v1/decide", json={"input": "a lovely day"})
            assert after.status_code == 200, after.text
            assert after.json()["label"] in ("negative", "positive")
            assert rec_c.bodies == [{"model": clf, "input": "a lovely day"}]
            assert "c" not in shell.state.replicas  # a classifier never enters the core
            assert await models(gw) == [MODEL]


async def test_a_routers_slots_follow_its_engines_through_reloads(tmp_path: Path) -> None:
    """The router's slots are its engines' sum: an engine added behind it by a reload
    is asked and the sum grows; one that cannot say its own (vLLM) makes the sum
    unknown, and the old sum is dropped rather than kept for a pool it no longer is;
    given in the file, it counts again."""
    from testkit.engine import EngineParams

    each = EngineParams.reference().max_running_requests  # what a fake SGLang says
    async with (
        engine() as (url_a, _),
        engine() as (url_b, _),
        engine(flavor="vllm") as (url_v, _),
        engine() as (url_r, _),  # stands in for the router
    ):
        a = {"name": "a", "url": url_a, "models": [MODEL]}
        b = {"name": "b", "url": url_b, "models": [MODEL]}
        v = {"name": "v", "url": url_v, "models": [MODEL], "kind": "vllm"}
        r = {"name": "r", "url": url_r, "models": [MODEL], "kind": "router"}
        path = tmp_path / "luftpause.toml"
        path.write_text(toml(a, b, v, {**r, "load_from": '["a"]'}))

        def slots() -> int | None:
            return shell.state.replicas["r"].spec.slots

        async with from_file(path) as (gw, shell):
            await until(lambda: slots() == each, "a's slots")
            path.write_text(toml(a, b, v, {**r, "load_from": '["a", "b"]'}))
            # b leaves the replicas (its turns go through r now): it is named too.
            assert (await gw.post("/reload")).json()["changed"] == ["b", "r"]
            await until(lambda: slots() == 2 * each, "a's and b's")
            path.write_text(toml(a, b, v, {**r, "load_from": '["a", "b", "v"]'}))
            assert (await gw.post("/reload")).status_code == 200
            assert slots() is None, "v says none: the sum is unknown at once"
            path.write_text(toml(a, b, {**v, "slots": 5}, {**r, "load_from": '["a", "b", "v"]'}))
            assert (await gw.post("/reload")).status_code == 200
            await until(lambda: slots() == 2 * each + 5, "the sum with v's from the file")


def test_a_reload_names_engines_that_leave_or_join_the_replicas_and_moves_no_replica(
    tmp_path: Path,
) -> None:
    """An engine moved behind a router leaves the replicas with its entry unchanged: the
    reload's answer said nothing of it (only the router, added).  A classifier or an
    engine behind a router holds no runs: its URL may change; a replica's may not
    (helper-157: all three were refused alike)."""
    path = tmp_path / "luftpause.toml"

    def config(*endpoints: dict[str, Any]) -> Config:
        path.write_text(toml(*endpoints))
        return load_config(path)

    a = {"name": "a", "url": "http://127.0.0.1:1001", "models": [MODEL]}
    e = {"name": "e", "url": "http://127.0.0.1:1002", "models": [MODEL]}
    r = {"name": "r", "url": "http://127.0.0.1:1003", "models": [MODEL], "kind": "router"}
    c = {"name": "c", "url": "http://127.0.0.1:1004", "models": ["clf"], "kind": "classifier"}
    behind = {**r, "load_from": '["e"]'}
    moved = {**e, "url": "http://127.0.0.1:2002"}
    change = compare(config(a, e, c), config(a, e, c, behind))
    assert (change.added, change.removed, change.changed) == (("r",), (), ("e",))
    change = compare(config(a, e, behind), config(a, e))
    assert (change.added, change.removed, change.changed) == ((), ("r",), ("e",))
    change = compare(config(a, e, behind), config(a, moved, behind))
    assert change.changed == ("e",)
    change = compare(config(a, c), config(a, {**c, "url": "http://127.0.0.1:2004"}))
    assert change.changed == ("c",)
    with pytest.raises(ConfigError, match=r"endpoint e: url 'http://127\.0\.0\.1:1002' -> "):
        compare(config(a, e), config(a, moved))
    # Back to the replicas while the core still knows it as it was (its turns there):
    (known,) = [x for x in config(a, e).endpoints if x.name == "e"]
    with pytest.raises(ConfigError, match=r"endpoint e: url"):
        compare(config(a, e, behind), config(a, moved), known={"e": known})


async def test_a_bug_off_the_turn_paths_is_answered_in_the_error_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anything unforeseen (a RecursionError from tomllib was one) on /reload, /status,
    count_tokens ...: `{"error": {"message"}}` naming no more than its type, not a
    text/plain 500 (helper-143)."""
    async with engine() as (url, _):
        path = tmp_path / "luftpause.toml"
        path.write_text(toml({"name": "a", "url": url, "models": [MODEL]}))
        async with from_file(path) as (gw, _):

            def broken(*args: object) -> None:
                raise RuntimeError("a secret in a bug's text")

            monkeypatch.setattr("gateway.app.load_config", broken)
            r = await gw.post("/reload")
            assert r.status_code == 500
            message = "internal error in the gateway (RuntimeError; its log has more)"
            assert r.json() == {"error": {"message": message}}
