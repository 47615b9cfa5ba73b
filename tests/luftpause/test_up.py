"""`luftpause up` as a user runs it: a subprocess on free ports with a clean state
directory, driven over MCP, stopped with SIGTERM — and restarted mid-run."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from temporalio.client import Client as TemporalClient

from luftpause import native, temporal_dev
from luftpause.temporal_dev import DevServer, StartInterrupted, free_port
from luftpause.up import Interrupted, _banner, wait_http
from tests.children import communicate
from tests.luftpause.test_process import wait_gone
from tests.workflows.harness import task_with

EXE = str(Path(sys.executable).parent / "luftpause")
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0


def children_of(pid: int) -> set[int]:
    """PIDs whose parent is `pid` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.add(int(entry))
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Up:
    def __init__(
        self,
        state: Path,
        time_scale: float,
        config: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.state = state
        self.ports = {"port": free_port(), "temporal": free_port(), "ui": free_port()}
        self.time_scale = time_scale
        self.config = config  # --config: the user's file
        self.env = env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['port']}"

    async def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                EXE,
                "up",
                "--port",
                str(self.ports["port"]),
                "--temporal-port",
                str(self.ports["temporal"]),
                "--ui-port",
                str(self.ports["ui"]),
                "--state-dir",
                str(self.state),
                "--time-scale",
                str(self.time_scale),
                *(["--config", str(self.config)] if self.config is not None else []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "LUFTPAUSE_TOKEN"} | self.env,
        )
        assert self.proc.stdout is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while loop.time() < deadline:
            line = await asyncio.wait_for(
                loop.run_in_executor(None, self.proc.stdout.readline), deadline - loop.time()
            )
            if not line:
                raise AssertionError("luftpause up exited:\n" + "".join(self.output))
            self.output.append(line)
            if line.startswith("Ctrl-C stops everything"):
                return
        raise AssertionError("luftpause up never came up:\n" + "".join(self.output))

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> tuple[int, set[int]]:
        """`sig` by PID; the exit status and the children that were running."""
        assert self.proc is not None
        kids = children_of(self.proc.pid)
        self.proc.send_signal(sig)
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.output.append(out)
        return self.proc.returncode, kids

    def kill_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for kid in children_of(self.proc.pid):
                os.kill(kid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()  # else a later test meets its ResourceWarning


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"


async def spawn(c: Client, task: str) -> str:
    r = await c.call_tool("spawn", {"task": task, "tools": ["lookup"]})
    assert not r.is_error, r.content
    return str(r.structured_content["handle"])


async def test_up_runs_sub_agents_and_stops_everything(state: Path) -> None:
    up = Up(state, time_scale=20)
    try:
        await up.start()
        text = "".join(up.output)
        assert (
            f"claude mcp add --transport http luftpause http://localhost:{up.ports['port']}/mcp"
            in text
        )
        async with Client(f"{up.gateway}/mcp") as c:
            handles = [await spawn(c, task_with(2, f"up{i}")) for i in range(4)]
            r = await c.call_tool("await", {"handles": handles, "timeout": 120})
            runs = r.structured_content["runs"]
        assert [x["state"] for x in runs] == ["Completed"] * 4
        assert all(x["toolCalls"] == 2 for x in runs)
        # The gateway and the worker froze their startup heaps once started.
        for name in ("gateway", "worker"):
            log = (state / "logs" / f"{name}.log").read_text()
            logged = re.search(r"froze ([\d,]+) objects", log)
            assert logged and int(logged[1].replace(",", "")) > 50_000, name
        # ... and the gateway said how its scheduler core runs: as this checkout built it.
        gateway_log = (state / "logs" / "gateway.log").read_text()
        build = re.escape(native.core_build())
        assert re.search(rf"scheduler core: {build}$", gateway_log, re.MULTILINE), build
        # The state (the Temporal database: every run's transcript) is its owner's alone.
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert stat.S_IMODE((state / "logs").stat().st_mode) == 0o700
        # No API docs to browse without a token.
        for path in ("/docs", "/redoc", "/openapi.json"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{up.gateway}{path}", timeout=10)
            refused.value.close()  # its socket, else a ResourceWarning in a later test
            assert refused.value.code == 404, path
        # The fake pool's classifier has its classes named: decide's label is among them.
        body = json.dumps({"input": "hello"}).encode()
        ask = urllib.request.Request(
            f"{up.gateway}/v1/decide", data=body, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(ask, timeout=10) as answered:
            decided = json.load(answered)
        assert set(decided["probabilities"]) == {"negative", "positive"}, decided
        assert decided["label"] in decided["probabilities"]
        # The fake engines serve Claude Code's and Codex's APIs too, through the gateway.
        hello = [{"role": "user", "content": "hello"}]
        for path, turn, kind in (
            ("/v1/messages", {"max_tokens": 8, "messages": hello}, "message"),
            ("/v1/responses", {"max_output_tokens": 8, "input": "hello"}, "response"),
        ):
            body = json.dumps({"model": "llama-3.2-1b", **turn}).encode()
            ask = urllib.request.Request(
                f"{up.gateway}{path}", data=body, headers={"content-type": "application/json"}
            )
            with urllib.request.urlopen(ask, timeout=10) as answered:
                reply = json.load(answered)
            assert reply.get("type", reply.get("object")) == kind, reply
        # The banner's load command works against it.
        assert f"luftpause load --url {up.gateway} --minutes 1" in text
        load = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "luftpause"),
            *f"load --url {up.gateway} --minutes 1 --runs 3 --batch 2 --interactive 1".split(),
            *["--tool-s", "0.1", "--context-chars", "1000", "--json"],
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await communicate(load, 90)
        assert load.returncode == 0, err.decode()
        loaded = json.loads(out)
        assert loaded["interactive_runs"] + loaded["batch_runs"] == 3 and not loaded["errors"]
        # The Temporal UI answers, and Temporal lists the four workflows.
        with urllib.request.urlopen(f"http://127.0.0.1:{up.ports['ui']}/", timeout=10) as ui:
            assert ui.status == 200
        temporal = await TemporalClient.connect(f"127.0.0.1:{up.ports['temporal']}")
        listed = {wf.id async for wf in temporal.list_workflows("WorkflowType = 'AgentRun'")}
        assert listed == set(handles)
        # A child that dies is restarted: kill the worker; a new run still completes.
        assert up.proc is not None
        (worker,) = [k for k in children_of(up.proc.pid) if b"worker" in cmdline(k)]
        os.kill(worker, signal.SIGKILL)
        async with Client(f"{up.gateway}/mcp") as c:
            handle = await spawn(c, task_with(1, "after-restart"))
            r = await c.call_tool("await", {"handles": [handle], "timeout": 120})
        assert r.structured_content["runs"][0]["state"] == "Completed"
        (again,) = [k for k in children_of(up.proc.pid) if b"worker" in cmdline(k)]
        assert again != worker
        code, kids = up.stop()
        assert code == 0, "".join(up.output)
        assert "worker exited (-9); restarting it" in "".join(up.output)
        assert len(kids) == 6  # temporal, 2 engines, fake MCP, gateway, worker
        assert not [k for k in kids if alive(k)]
    finally:
        up.kill_all()


async def test_a_restart_resumes_unfinished_runs(state: Path) -> None:
    # Real-time tools (lookups of 0.5-1.5 s): the runs are mid-way when `up` stops.
    up = Up(state, time_scale=1)
    try:
        await up.start()
        async with Client(f"{up.gateway}/mcp") as c:
            handles = [await spawn(c, task_with(3, f"resume{i}")) for i in range(4)]
            r = await c.call_tool("await", {"handles": handles, "timeout": 1})
            assert not r.structured_content["done"]
        # The terminal `make up` ran in is closed: everything stops in order.
        code, kids = up.stop(signal.SIGHUP)
        assert code == 0, "".join(up.output)
        assert len(kids) == 6
        assert wait_gone(kids, 0) == set()
        again = Up(state, time_scale=1)
        again.ports = up.ports
        up = again
        await up.start()
        async with Client(f"{up.gateway}/mcp") as c:
            r = await c.call_tool("await", {"handles": handles, "timeout": 120})
        runs = r.structured_content["runs"]
        assert [x["state"] for x in runs] == ["Completed"] * 4, runs
        assert all(x["toolCalls"] == 3 for x in runs)
        # `up` is killed outright (the OOM killer): it cannot stop its children, and
        # the kernel does, so nothing is left holding the ports or the Temporal db.
        assert up.proc is not None
        kids = children_of(up.proc.pid)
        assert len(kids) == 6
        code, _ = up.stop(signal.SIGKILL)
        assert code == -signal.SIGKILL
        assert wait_gone(kids, 30) == set()
    finally:
        up.kill_all()


async def test_a_port_in_use_is_named_with_its_flag(state: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # (Free ports for the others: should the check come later, nothing binds 7233.)
        others = f"--temporal-port {free_port()} --ui-port {free_port()}"
        out = subprocess.run(
            [EXE, "up", "--port", str(port), *others.split(), "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        # `make up` passes ARGS on: the README's way to choose ports.
        args = f"ARGS=--port {port} {others} --state-dir {state}"
        made = subprocess.run(
            ["make", "-s", "up", args], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    assert out.returncode == 2
    assert (
        f"port {port} is already in use; choose another with --port N "
        '(make up ARGS="--port N")' in out.stderr
    )
    assert f"port {port} is already in use" in made.stderr, made.stderr


def test_waiting_for_a_child_ends_when_up_is_asked_to_stop() -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(Interrupted, match="stopped while waiting for the gateway"):
        # Nothing listens there: without the event it would wait out its 60 s.
        wait_http(f"http://127.0.0.1:{free_port()}/health", "the gateway", None, stop=stop)


def test_the_dev_server_asked_to_stop_while_starting_is_stopped_again(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    server = DevServer(log_file=tmp_path / "temporal.log")
    spawned: list[int] = []
    real_spawn = temporal_dev.spawn

    def spy(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real_spawn(*args, **kwargs)
        spawned.append(proc.pid)
        return proc

    temporal_dev.spawn = spy  # type: ignore[assignment]
    try:
        with pytest.raises(StartInterrupted):
            server.start(stop)
    finally:
        temporal_dev.spawn = real_spawn  # type: ignore[assignment]
    assert len(spawned) == 1 and server.process is None
    assert not alive(spawned[0]), "stopped by its PID, not left listening"


def test_ctrl_c_while_starting_stops_what_started_at_once(state: Path) -> None:
    # Before: the signal was only looked at once every process had come up (several
    # seconds, the banner printed), then everything stopped.
    argv = [EXE, "up", "--state-dir", str(state), "--time-scale", "20"]
    for flag in ("--port", "--temporal-port", "--ui-port"):
        argv += [flag, str(free_port())]
    env = {k: v for k, v in os.environ.items() if k != "LUFTPAUSE_TOKEN"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        temporal = None
        while temporal is None and time.monotonic() < deadline and proc.poll() is None:
            temporal = next((k for k in children_of(proc.pid) if b"start-dev" in cmdline(k)), None)
            if temporal is None:
                time.sleep(0.02)  # polling /proc: no event says a child was spawned
        assert temporal is not None, "the Temporal dev server never started"
        kids = children_of(proc.pid)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        text = out.decode(errors="replace")
        assert proc.returncode == 0 and text.endswith("stopped.\n"), text
        assert "luftpause is up" not in text and "Traceback" not in text, text
        assert temporal in kids and not wait_gone(kids, 15), "every child stopped by its PID"
    finally:
        if proc.poll() is None:
            for kid in children_of(proc.pid):
                os.kill(kid, signal.SIGKILL)
            proc.kill()
            proc.communicate()


async def test_up_with_a_file_serves_its_callers_by_their_own_tokens(
    state: Path, tmp_path: Path
) -> None:
    """`up --config` with the operator's token and two `[[callers]]`, their tokens in
    the environment: each caller's token is that caller on the proxy and over MCP,
    and the worker (the operator's token) runs a caller's sub-agent to its end.  The
    file names a Temporal namespace of its own, which up's dev server makes (the
    worker died without it), and the worker's log holds an earlier start's ready line
    (up took it for this start's and said it was up)."""
    engine_port = free_port()
    config = tmp_path / "luftpause.toml"
    config.write_text(
        f"""token = "op"

[[endpoints]]
name = "fake"
url = "http://127.0.0.1:{engine_port}"
kind = "sglang"
models = ["llama-3.2-1b"]

[[callers]]
name = "team-a"
token_env = "TEAM_A_TOKEN"

[[callers]]
name = "team-b"
token_env = "TEAM_B_TOKEN"

[temporal]
namespace = "agents"
"""
    )
    (state / "logs").mkdir(parents=True)
    (state / "logs" / "worker.log").write_text("INFO luftpause.worker: worker on task queue\n")
    up = Up(state, 20, config, {"TEAM_A_TOKEN": "tok-a", "TEAM_B_TOKEN": "tok-b"})

    def post(path: str, body: dict[str, object], token: str, run: str) -> int:
        ask = urllib.request.Request(
            f"{up.gateway}{path}",
            data=json.dumps(body).encode(),
            headers={
                "content-type": "application/json",
                "authorization": f"Bearer {token}",
                "x-luftpause-run-id": run,
            },
        )
        try:
            with urllib.request.urlopen(ask, timeout=30) as answered:
                return int(answered.status)
        except urllib.error.HTTPError as refused:
            return refused.code

    def runs(token: str) -> list[str]:
        ask = urllib.request.Request(
            f"{up.gateway}/v1/runs", headers={"authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(ask, timeout=10) as answered:
            return [r["run_id"] for r in json.load(answered)["runs"]]

    # (Started before the try, it outlived a failure in between; helper-165.)
    engine = subprocess.Popen(
        [EXE, "fake-engine", "--port", str(engine_port), "--instant"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await up.start()
        # The banner's load commands send the token (helper-127: they got 401).
        banner = "".join(up.output)
        assert f'load --url {up.gateway} --token "<the token of {config}>" --minutes' in banner
        # Its sub-agent load names no tool of the fake MCP server, which is not up here
        # (helper-162: `--tools lookup` failed on every file without one).
        assert "--tools lookup" not in banner and "(no tools configured" in banner, banner
        turn = {"model": "llama-3.2-1b", "messages": [{"role": "user", "content": "hi"}]}
        assert post("/v1/chat/completions", turn, "tok-a", "ra") == 200
        assert post("/v1/chat/completions", turn, "tok-b", "ra") == 403
        assert runs("tok-a") == ["ra"] and runs("tok-b") == []
        http = httpx2.AsyncClient(
            headers={"authorization": "Bearer tok-a"}, timeout=httpx2.Timeout(30.0, read=None)
        )
        async with http, Client(streamable_http_client(f"{up.gateway}/mcp", http_client=http)) as c:
            r = await c.call_tool("spawn", {"task": "say hi", "model": "llama-3.2-1b"})
            assert not r.is_error, r.content
            handle = r.structured_content["handle"]
            r = await c.call_tool("await", {"handles": [handle], "timeout": 120})
        assert r.structured_content["runs"][0]["state"] == "Completed", r.structured_content
        temporal = await TemporalClient.connect(
            f"127.0.0.1:{up.ports['temporal']}", namespace="agents"
        )
        assert (await temporal.get_workflow_handle(handle).describe()).status is not None
        code, _ = up.stop()
        assert code == 0, "".join(up.output)
    finally:
        up.kill_all()
        engine.terminate()
        engine.wait(30)


def test_a_state_directory_in_use_or_unusable_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    # Two `up`s in one directory shared one Temporal database and one generated config
    # (a restarted gateway served the other's engines); a file as the directory gave a
    # traceback (helper-101).
    import fcntl

    def up(state: Path) -> subprocess.CompletedProcess[str]:
        ports = [str(free_port()) for _ in range(3)]
        argv = ["--port", ports[0], "--temporal-port", ports[1], "--ui-port", ports[2]]
        return subprocess.run(
            [EXE, "up", *argv, "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with open(state / "up.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running `up` holds it
        out = up(state)
    assert out.returncode == 2
    assert f"another luftpause up is using {state}; stop it, or give this one" in out.stderr
    assert not (state / "temporal.db").exists()  # nothing started
    afile = tmp_path / "afile"
    afile.write_text("")
    out = up(afile)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"--state-dir {afile}: cannot use it (" in out.stderr, out.stderr


def test_up_says_it_failed_when_a_part_keeps_exiting(tmp_path: Path) -> None:
    # It gave up on a child that kept dying and exited 0 (helper-101).
    import argparse

    from luftpause import up as up_module

    said: list[str] = []
    args = argparse.Namespace(state_dir=str(tmp_path))
    up = up_module.Up(args, said.append)
    (tmp_path / "logs").mkdir()
    up.child("flaky", [sys.executable, "-c", "raise SystemExit(3)"])
    try:
        assert up.supervise() is False
    finally:
        up.stop()
    assert said[-1].startswith("flaky keeps exiting; see ")
    assert (
        said.count(
            "flaky exited (3); restarting it (log: " + str(tmp_path / "logs" / "flaky.log") + ")"
        )
        == 5
    )


def test_up_refuses_a_temporal_api_key_even_with_tls_false(tmp_path: Path) -> None:
    # up runs its own dev server, plain and keyless: a key is refused whatever `tls`
    # says (helper-207 let tls = false turn TLS off beside a key; the check read TLS).
    import argparse

    from luftpause import up as up_module

    config = tmp_path / "luftpause.toml"
    config.write_text(
        '[[endpoints]]\nname = "e0"\nurl = "http://127.0.0.1:9"\nkind = "sglang"\n'
        'models = ["m"]\n\n[temporal]\napi_key_env = "TEMPORAL_API_KEY"\ntls = false\n'
    )
    ports = {"port": free_port(), "temporal_port": free_port(), "ui_port": free_port()}
    args = argparse.Namespace(state_dir=str(tmp_path / "state"), config=str(config), **ports)
    up = up_module.Up(args, lambda line: None)
    try:
        with pytest.raises(up_module.UpError, match=r"\[temporal\] asks for TLS or an API key"):
            up.start()
    finally:
        up.stop()  # (what a start that was not refused started)
    assert not (tmp_path / "state").exists()  # refused before anything started


def test_the_banners_sub_agent_load_names_tools_only_where_it_knows_them() -> None:
    # `--tools lookup` is the fake MCP server's; a file's own servers are called for
    # real, so the banner names none of them (helper-162).
    where = {
        "gateway": "http://127.0.0.1:9",
        "ui": "u",
        "temporal": "t",
        "engines": "e",
        "config": "c",
    }
    fake = _banner({**where, "tools": "http://127.0.0.1:8/mcp"}, None)
    assert "--subagents 16 --rounds 3 --tools lookup\n" in fake
    none = _banner({**where, "tools": ""}, None, fake_tools=False)
    assert "tools         (none configured)" in none and "--tools" not in none
    assert "--rounds 3   (no tools configured: they answer without)" in none
    mine = _banner({**where, "tools": "https://mcp.example/mcp"}, None, fake_tools=False)
    assert "--tools NAME,..." in mine and "lookup" not in mine
    assert "their runs call your tools for real" in mine
