"""The `luftpause` command as a process: what holds whichever subcommand runs."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from luftpause.temporal_dev import free_port
from luftpause.up import Child, wait_http
from tests.children import communicate_sync

EXE = str(Path(sys.executable).parent / "luftpause")
MODEL = "llama-3.2-1b"


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[int, Child, Child]]:
    """`luftpause fake-engine` and `luftpause gateway` in front of it, as processes."""
    engine_port, gateway_port = free_port(), free_port()
    engine = Child("engine", [EXE, "fake-engine", "--port", str(engine_port)], tmp_path / "e.log")
    config = tmp_path / "luftpause.toml"
    config.write_text(
        f'[[endpoints]]\nname = "e"\nurl = "http://127.0.0.1:{engine_port}"\n'
        f'kind = "sglang"\nmodels = ["{MODEL}"]\n'
    )
    gw = Child(
        "gateway",
        [EXE, "gateway", "--config", str(config), "--port", str(gateway_port)],
        tmp_path / "g.log",
        env={"LUFTPAUSE_TOKEN": ""},
    )
    try:
        engine.start()
        wait_http(f"http://127.0.0.1:{engine_port}/health", "fake engine", engine)
        gw.start()
        wait_http(f"http://127.0.0.1:{gateway_port}/health", "gateway", gw)
        yield gateway_port, gw, engine
    finally:
        gw.stop()
        engine.stop()


def _reset_mid_stream(port: int, body: bytes) -> None:
    """Send a streamed turn, read its first bytes, and reset the connection (RST)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: luftpause\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        s.recv(256)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_servers_outlive_clients_that_reset_their_connections(
    gateway: tuple[int, Child, Child],
) -> None:
    # A client that leaves mid-stream makes the gateway (and, through it, the engine)
    # write to a reset connection.  With SIGPIPE at its default action (as the CLI once
    # set it for `| head`) that write killed the process: the fake engine in the first
    # round of 40 here, the gateway at the end of a benchmark's load.
    port, gw, engine = gateway
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 200,
            "messages": [{"role": "user", "content": "hello " * 50}],
        }
    ).encode()
    for _ in range(3):
        clients = [threading.Thread(target=_reset_mid_stream, args=(port, body)) for _ in range(40)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        assert gw.alive() and engine.alive(), (gw.proc.poll(), engine.proc.poll())  # type: ignore[union-attr]
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200
        assert json.load(r)["choices"][0]["message"]["content"]


def _log_shows(child: Child, needle: str, timeout: float = 30.0) -> None:
    """Wait (bounded) until the process has logged `needle`."""
    deadline = time.monotonic() + timeout
    while needle not in child.log.read_text(errors="replace"):
        assert child.alive() and time.monotonic() < deadline, f"no {needle!r} in {child.log}"
        time.sleep(0.05)


def test_sighup_reloads_the_pool_and_a_bad_file_changes_nothing(
    gateway: tuple[int, Child, Child], tmp_path: Path
) -> None:
    port, gw, _ = gateway
    config = tmp_path / "luftpause.toml"
    url = config.read_text().split('url = "')[1].split('"')[0]

    def served() -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            return [m["id"] for m in json.load(r)["data"]]

    assert served() == [MODEL]
    config.write_text(
        config.read_text()
        + f'\n[[endpoints]]\nname = "e2"\nurl = "{url}"\nkind = "vllm"\nmodels = ["other"]\n'
    )
    assert gw.proc is not None
    os.kill(gw.proc.pid, signal.SIGHUP)
    _log_shows(gw, "reloaded")
    assert served() == [MODEL, "other"]
    config.write_text("[[endpoints]]\nname = 3\n")
    os.kill(gw.proc.pid, signal.SIGHUP)
    _log_shows(gw, "reload on SIGHUP: ")
    assert gw.alive() and served() == [MODEL, "other"]


def test_a_sighup_while_the_gateway_starts_is_a_reload_once_it_is_up(tmp_path: Path) -> None:
    # `kill -HUP` (systemd's ExecReload, a config reloader) while the gateway started,
    # before its first probe round had ended and the reload handler was installed, ended
    # it: SIGHUP's default action (helper-157).  It is held, and carried out once up.
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    config = tmp_path / "luftpause.toml"
    config.write_text(
        f'[probes]\ntimeout_s = 3.0\n\n[[endpoints]]\nname = "e"\n'
        f'url = "http://127.0.0.1:{silent.getsockname()[1]}"\nkind = "sglang"\n'
        f'models = ["{MODEL}"]\n'
    )
    port = free_port()
    gw = Child(
        "gateway",
        [EXE, "gateway", "--config", str(config), "--port", str(port)],
        tmp_path / "g.log",
        env={"LUFTPAUSE_TOKEN": ""},
    )
    silent.settimeout(60)
    try:
        gw.start()
        probe, _ = silent.accept()  # the first probe round: the gateway is starting
        assert gw.proc is not None
        os.kill(gw.proc.pid, signal.SIGHUP)
        wait_http(f"http://127.0.0.1:{port}/health", "gateway", gw)
        _log_shows(gw, "a SIGHUP came while starting: reloading now")
        _log_shows(gw, "reloaded")
        assert gw.alive()
        probe.close()
    finally:
        gw.stop()
        silent.close()


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    # `luftpause sim routing | head -1`: the reader is gone before the table is written.
    proc = subprocess.Popen(
        [EXE, "sim", "routing", "--minutes", "0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = communicate_sync(proc, 120)
    assert proc.returncode == 128 + signal.SIGPIPE
    assert err == b""  # no BrokenPipeError traceback


def _get_health(s: socket.socket) -> bytes:
    s.sendall(b"GET /health HTTP/1.1\r\nhost: luftpause\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            return head  # closed by the gateway
        head += chunk
    headers, _, body = head.partition(b"\r\n\r\n")
    length = int(
        next(
            h.split(b":")[1]
            for h in headers.split(b"\r\n")
            if h.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += s.recv(4096)
    return headers


def test_the_gateway_keeps_an_idle_connection_longer_than_client_pools_do(
    gateway: tuple[int, Child, Child],
) -> None:
    # httpx and the OpenAI SDKs keep an idle connection 5 s; uvicorn closed it after 5 s
    # too, so a turn sent on it as the gateway closed it failed (httpx.ReadError).
    port, _, _ = gateway
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        assert _get_health(s).startswith(b"HTTP/1.1 200")
        time.sleep(6.0)  # idle past the 5 s of the clients' pools (the behaviour under test)
        assert _get_health(s).startswith(b"HTTP/1.1 200")


def test_the_gateway_process_keeps_its_startup_heap_from_the_collector(
    gateway: tuple[int, Child, Child],
) -> None:
    # A full collection walked the ~150k objects of the imports and stopped every
    # stream for ~100 ms under load; the gateway freezes them once it has started.
    port, _, _ = gateway
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    (line,) = [s for s in text.splitlines() if s.startswith("luftpause_gc_frozen_objects ")]
    assert float(line.split()[1]) > 50_000, line


def test_a_stopping_gateway_lets_the_turns_in_flight_finish(tmp_path: Path) -> None:
    # A deploy sends SIGTERM: a reply streaming meanwhile (here ~7 s) is let finish
    # within --shutdown-grace-s, instead of being cut after uvicorn's few seconds.  A
    # turn held for the slot is answered 503 at once (helper-112: it waited out the
    # grace, then got a text 500).
    engine_port, gateway_port = free_port(), free_port()
    engine = Child(
        "engine",
        [EXE, "fake-engine", "--port", str(engine_port), "--time-scale", "0.25"],
        tmp_path / "e.log",
    )
    config = tmp_path / "luftpause.toml"
    config.write_text(
        f'[[endpoints]]\nname = "e"\nurl = "http://127.0.0.1:{engine_port}"\n'
        f'kind = "sglang"\nmodels = ["{MODEL}"]\nslots = 1\n'
    )
    argv = [EXE, "gateway", "--config", str(config), "--port", str(gateway_port)]
    gw = Child("gateway", [*argv, "--shutdown-grace-s", "20"], tmp_path / "g.log")
    held: list[tuple[int, float, dict[str, Any], str | None]] = []

    def second_turn() -> None:  # held: the one slot streams the first
        try:
            urllib.request.urlopen(request, timeout=60)
        except urllib.error.HTTPError as e:
            held.append((e.code, time.monotonic(), json.loads(e.read()), e.headers["retry-after"]))

    def held_turns() -> float:
        url = f"http://127.0.0.1:{gateway_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            lines = r.read().decode().splitlines()
        return sum(float(s.split()[-1]) for s in lines if s.startswith("luftpause_held_turns{"))

    try:
        engine.start()
        wait_http(f"http://127.0.0.1:{engine_port}/health", "fake engine", engine)
        gw.start()
        wait_http(f"http://127.0.0.1:{gateway_port}/health", "gateway", gw)
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "tell me a long story"}],
                "stream": True,
                "max_tokens": 256,
            }
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
            data=body,
            headers={"content-type": "application/json"},
        )
        started = time.monotonic()
        with urllib.request.urlopen(request, timeout=60) as r:
            first = r.readline()  # streaming: the turn is in flight
            assert first.startswith(b"data: ")
            waiting = threading.Thread(target=second_turn)
            waiting.start()
            for _ in range(200):  # bounded: 20 s
                if held_turns() == 1:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError("the second turn was never held")
            assert gw.proc is not None
            gw.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            waiting.join(timeout=30)
            rest = r.read()
            done = time.monotonic()
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert time.monotonic() - started > 5  # longer than the old, fixed grace
        ((status, answered, body, retry_after),) = held
        assert (status, retry_after) == (503, "2")
        assert "the gateway is shutting down" in body["error"]["message"]
        assert answered - signalled < done - signalled, "answered before the stream ended"
        # Then it exits (uvicorn re-raises the SIGTERM once it has shut down).
        assert gw.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        gw.stop()
        engine.stop()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("fake-engine", "--port", "70000"), "argument --port: expected a port 1-65535, got 70000"),
        (("fake-engine", "--port", "0"), "argument --port: expected a port 1-65535, got 0"),
        (("fake-mcp", "--port", "-1"), "argument --port: expected a port 1-65535, got -1"),
        (("gateway", "--port", "x"), "argument --port: expected a port 1-65535, got 'x'"),
        (("up", "--ui-port", "65536"), "argument --ui-port: expected a port 1-65535, got 65536"),
        (
            ("gateway", "--shutdown-grace-s", "nan"),
            "argument --shutdown-grace-s: expected finite seconds >= 0, got 'nan'",
        ),
        (("up", "--port", "{port}", "--ui-port", "{port}"), "--port and --ui-port are both {port}"),
        (  # refused by the fake engine only after up had started Temporal
            ("up", "--time-scale", "0"),
            "argument --time-scale: expected a finite number > 0, got '0'",
        ),
        (("fake-mcp", "--port", "{port}", "--time-scale", "nan"), "expected a finite number > 0"),
        (
            ("fake-engine", "--port", "{port}", "--kv-tokens", "0"),
            "luftpause fake-engine: kv_pool_tokens must hold at least one block",
        ),
        (  # every request with tools answered 500 (a ZeroDivisionError)
            ("fake-engine", "--port", "{port}", "--max-tool-calls", "-1"),
            "luftpause fake-engine: max_tool_calls must be at least 0, got -1",
        ),
        (  # exited 0 and printed "nan min"
            ("load", "--url", "http://127.0.0.1:9", "--minutes", "nan"),
            "--minutes must be a finite number > 0, got nan",
        ),
        (("bench", "flood", "--minutes", "nan"), "--minutes, --engines and --time-scale must be"),
        (("worker", "--shutdown-grace-s", "-1"), "expected finite seconds >= 0, got '-1'"),
        (  # a traceback
            ("fake-mcp", "--port", "{port}", "--counts-file", "/nonexistent/dir/counts.json"),
            "--counts-file /nonexistent/dir/counts.json: cannot write there (No such file",
        ),
    ],
)
def test_bad_flags_are_named_before_anything_starts(
    argv: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    # Found by helper-64: a port out of range was bound modulo 65536 (70000 -> 4464)
    # or picked at random; the others gave a traceback.  Should a check slip, what
    # starts binds free ports and (up) keeps its state here (helper-165: the rows' fixed
    # ports, and up's defaults, 7233 among them).
    port = str(free_port())
    args = [a.replace("{port}", port) for a in argv]
    message = message.replace("{port}", port)
    if args[0] == "up":
        for flag in ("--port", "--temporal-port", "--ui-port"):
            if flag not in args:
                args += [flag, str(free_port())]
        args += ["--state-dir", str(tmp_path / "state")]
    out = subprocess.run(
        [sys.executable, "-m", "luftpause", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_counts_file_that_is_a_directory_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "luftpause",
            "fake-mcp",
            "--port",
            "9",
            "--counts-file",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and f"--counts-file {tmp_path}: cannot write there" in out.stderr
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.parent.glob(f".{tmp_path.name}.*.tmp")), "its temporary file is gone"


def test_ctrl_c_in_a_report_ends_it_without_a_traceback() -> None:
    # `luftpause load` against a gateway that never answers: its first request is in
    # flight once our socket accepts it.
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.settimeout(60)
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "luftpause", "load", "--url", url, "--minutes", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            conn, _ = srv.accept()
            with conn:  # open, unanswered, until it has ended
                proc.send_signal(signal.SIGINT)
                _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130 and err == "luftpause load: interrupted\n", err


def test_a_worker_for_a_namespace_temporal_lacks_says_so_and_exits(
    tmp_path: Path, temporal_address: str
) -> None:
    # The worker said it was on its task queue, then died in the SDK's validation
    # (helper-101: `up --config` with a namespace of its own); leaving by SystemExit
    # it could also abort in temporalio's teardown (sdk-python#300), status 134.
    config = tmp_path / "luftpause.toml"
    config.write_text(
        '[[endpoints]]\nname = "e"\nurl = "http://127.0.0.1:9"\nkind = "sglang"\n'
        f'models = ["{MODEL}"]\n[temporal]\naddress = "{temporal_address}"\n'
        'namespace = "nowhere"\n'
    )
    out = subprocess.run(
        [EXE, "worker", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "LUFTPAUSE_TEMPORAL_NAMESPACE": ""},
    )
    assert out.returncode == 1, out.stderr
    assert f"Temporal at {temporal_address} has no namespace 'nowhere'" in out.stderr
    assert "worker on task queue" not in out.stderr
    assert "Traceback" not in out.stderr and "Fatal Python error" not in out.stderr


def test_tracing_settings_it_cannot_take_are_said_not_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "luftpause.toml"
    config.write_text(
        '[[endpoints]]\nname = "e"\nurl = "http://127.0.0.1:9"\nkind = "sglang"\n'
        f'models = ["{MODEL}"]\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_BSP_SCHEDULE_DELAY": "-5"}
    out = subprocess.run(
        [EXE, "gateway", "--config", str(config), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert (
        "luftpause gateway: tracing: the OTEL_* environment variables: "
        "schedule_delay_millis must be positive" in out.stderr
    )


def test_an_empty_luftpause_config_is_unset_for_the_worker_as_for_the_gateway(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # helper-127: the worker read "" as the path "." ("Is a directory").
    import argparse

    from worker.main import add_arguments

    monkeypatch.setenv("LUFTPAUSE_CONFIG", "")
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).config == "luftpause.toml"


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_no_file_where_it_looks_by_default_says_where_and_how_to_give_one(
    command: str, tmp_path: Path
) -> None:
    # helper-250: a first `luftpause gateway` outside a directory with a file was told
    # only "luftpause.toml: cannot read the configuration file: No such file or
    # directory", not where it looked nor how to name another file.
    env = {k: v for k, v in os.environ.items() if k != "LUFTPAUSE_CONFIG"}
    argv = [sys.executable, "-m", "luftpause", command]
    if command == "gateway":
        argv += ["--port", str(free_port())]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path, env=env
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert f"no luftpause.toml in {tmp_path}" in out.stderr, out.stderr
    assert "--config FILE, else $LUFTPAUSE_CONFIG" in out.stderr
    assert "`luftpause up`" in out.stderr


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("fake-engine",), "fake sglang engine on http://127.0.0.1:{port}"),
        (("fake-mcp", "--transport", "http"), "fake MCP server on http://127.0.0.1:{port}/mcp"),
    ],
)
def test_a_fake_says_where_it_serves_only_once_it_does(
    tmp_path: Path, argv: tuple[str, ...], says: str
) -> None:
    # It printed its URL, then uvicorn's bind error: a reader saw both.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [EXE, *argv, "--port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert out.returncode != 0 and "address already in use" in out.stderr, out.stderr
    assert "on http" not in out.stdout + out.stderr
    port = free_port()
    child = Child(argv[0], [EXE, *argv, "--port", str(port)], tmp_path / "f.log")
    try:
        child.start()
        _log_shows(child, says.format(port=port))
    finally:
        child.stop()


def test_help_says_what_luftpause_is_and_the_gateway_names_what_it_serves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # helper-229, a new user: `luftpause --help` printed cli.py's note for developers
    # ("Subcommands import what they need lazily ..."), and `gateway --help` named the
    # proxy's routes only.
    from luftpause.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps its lines
    assert "lazily" not in text and "Start with `luftpause up`" in text
    with pytest.raises(SystemExit) as done:
        main(["gateway", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    # Every route the app has, read from it (helper-239: the help left out
    # /v1/messages/count_tokens and the per-run and per-model paths).  A static path is
    # named as a word of its own (not only inside a longer one); a path with a parameter
    # by its text up to the parameter ("/v1/runs/{").  The catch-all under /v1, which
    # answers what is not served, is no route to name.
    from gateway.app import GatewaySettings, create_app
    from luftpause.config import parse_config

    endpoint = {"name": "e", "url": "http://127.0.0.1:9", "kind": "sglang", "models": [MODEL]}
    app = create_app(GatewaySettings(config=parse_config({"endpoints": [endpoint]})))
    paths = {r.path for r in app.routes if getattr(r, "include_in_schema", True)}
    assert {"/mcp", "/v1/messages/count_tokens", "/v1/runs/{run_id}"} <= paths  # the read

    def named(path: str) -> bool:
        if "{" in path:
            return (
                re.search(r"(^|[\s(])" + re.escape(path[: path.index("{") + 1]), text) is not None
            )
        return re.search(rf"(^|[\s(]){re.escape(path)}($|[\s,;.)])", text) is not None

    assert sorted(p for p in paths if not named(p)) == []
