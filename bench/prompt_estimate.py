"""How far the gateway's estimate of a turn's prompt is from the engine's count.

    .venv/bin/python -m bench.prompt_estimate --llama-server PATH --model GGUF [--json]
    .venv/bin/python -m bench.prompt_estimate --url http://127.0.0.1:30000 --model-name M

The gateway tells the core a turn's prompt before the engine has seen it: a quarter of
the request's bytes (`gateway.app._prompt_tokens`), and program-level KV admission
leans on that number (bench/RESULTS.md: the flood's bar holds for an estimate within
about 10 % of the engine's count).  This sends request bodies of several shapes to a
real engine, one token each, and compares the estimate with the engine's
`usage.prompt_tokens`, which counts its chat template and, where the template renders
them, the tool schemas:

- `prose-2k`, `prose-8k`: English technical prose (this checkout's README) as a task;
- `code-8k`: Python source as a task;
- `chat-20`: twenty short messages (JSON's share of the bytes at its largest);
- `agent`: a system prompt, a task, six tool schemas, three tool calls and their
  results (file text and JSON), as a harness's turn after a few tool calls.

With `--llama-server` it starts llama-server (`--jinja`, so that tools reach the
template) and stops it by its PID at the end; with `--url` it asks a running
OpenAI-compatible engine.  Each body is sent `--repeat` times (the count is the same
each time; the repeat checks it).  Prints a table, or JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.app import _prompt_tokens
from luftpause._process import spawn, terminate
from luftpause.native import ROOT
from luftpause.temporal_dev import free_port
from testkit.bench_agents import llama_server_argv

READY_S = 60.0

_TOOLS = [
    ("read_file", "Read a file of the workspace.", {"path": "string", "offset": "integer"}),
    ("edit_file", "Replace text in a file.", {"path": "string", "old": "string", "new": "string"}),
    ("bash", "Run a shell command.", {"command": "string", "timeout_s": "number"}),
    ("search", "Search the workspace for a regular expression.", {"pattern": "string"}),
    ("list_dir", "List a directory.", {"path": "string"}),
    ("web_fetch", "Fetch a URL and return its text.", {"url": "string"}),
]


def _tools() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": doc,
                "parameters": {
                    "type": "object",
                    "properties": {
                        k: {"type": t, "description": f"the {k}"} for k, t in ps.items()
                    },
                    "required": list(ps)[:1],
                },
            },
        }
        for name, doc, ps in _TOOLS
    ]


def _text(path: Path, chars: int, skip: int = 0) -> str:
    return path.read_text(encoding="utf-8")[skip : skip + chars]


def bodies(model: str) -> dict[str, dict[str, Any]]:
    """The request bodies measured, by name (see the module's docstring)."""
    readme, source = ROOT / "README.md", ROOT / "gateway" / "_proxy.py"

    def task(content: str) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": content}]}

    chat = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Step {i}: done, next?"}
        for i in range(20)
    ]
    calls = [("read_file", {"path": "gateway/_proxy.py"}), ("list_dir", {"path": "gateway"}),
             ("search", {"pattern": "def engine_fault"})]  # fmt: skip
    results = [
        _text(source, 3000, 2000),
        json.dumps(sorted(p.name for p in (ROOT / "gateway").iterdir())),
        json.dumps([{"path": "gateway/_proxy.py", "line": 123, "text": "def engine_fault("}]),
    ]
    agent: list[dict[str, Any]] = [
        {"role": "system", "content": _text(readme, 1500)},
        {"role": "user", "content": "Find where an engine's error status counts toward ejection."},
    ]
    for i, ((name, args), result) in enumerate(zip(calls, results, strict=True)):
        call_id = f"call_{i}"
        function = {"name": name, "arguments": json.dumps(args)}
        call = {"id": call_id, "type": "function", "function": function}
        agent.append({"role": "assistant", "content": None, "tool_calls": [call]})
        agent.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return {
        "prose-2k": task(_text(readme, 2000, 4000)),
        "prose-8k": task(_text(readme, 8000, 4000)),
        "code-8k": task(_text(source, 8000)),
        "chat-20": {"model": model, "messages": chat},
        "agent": {"model": model, "messages": agent, "tools": _tools()},
    }


def measure(url: str, model: str, repeat: int) -> dict[str, Any]:
    rows = {}
    with httpx.Client(timeout=120) as client:
        for name, body in bodies(model).items():
            raw = json.dumps({**body, "max_tokens": 1}).encode()
            counts = set()
            for _ in range(repeat):
                r = client.post(
                    f"{url}/v1/chat/completions",
                    content=raw,
                    headers={"content-type": "application/json"},
                )
                r.raise_for_status()
                counts.add(r.json()["usage"]["prompt_tokens"])
            if len(counts) != 1:
                raise SystemExit(f"{name}: the engine counted {sorted(counts)} for one body")
            (engine,) = counts
            estimate = _prompt_tokens(raw)
            rows[name] = {
                "bytes": len(raw),
                "estimate": estimate,
                "engine": engine,
                "ratio": round(estimate / engine, 3),
            }
    return rows


def table(report: dict[str, Any]) -> str:
    head = f"{'body':<10}{'bytes':>8}{'estimate':>10}{'engine':>8}{'estimate/engine':>17}"
    lines = [head, "-" * len(head)]
    for name, r in report["bodies"].items():
        lines.append(
            f"{name:<10}{r['bytes']:>8}{r['estimate']:>10}{r['engine']:>8}{r['ratio']:>17.3f}"
        )
    lines.append(f"engine: {report['engine']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.prompt_estimate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--llama-server", help="llama-server executable (started here)")
    p.add_argument("--model", help="GGUF for --llama-server")
    p.add_argument("--url", help="a running OpenAI-compatible engine instead")
    p.add_argument("--model-name", default="m", help="the model name sent (with --url)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if bool(args.url) == bool(args.llama_server) or (args.llama_server and not args.model):
        p.error("give --url, or --llama-server with --model")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    proc: subprocess.Popen[bytes] | None = None
    logs = Path(tempfile.mkdtemp(prefix="prompt-estimate-"))
    try:
        if args.llama_server:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            argv_ = llama_server_argv(args.llama_server, args.model, "m", port, 1, 16384, 2)
            with (logs / "engine.log").open("wb") as log:
                proc = spawn([*argv_, "--jinja"], stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + READY_S
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"llama-server did not start; see {logs}/engine.log")
                time.sleep(0.2)
            engine = f"llama-server {Path(args.model).name} (--jinja)"
            model = "m"
        else:
            url, engine, model = args.url.rstrip("/"), args.url, args.model_name
        report = {
            "engine": engine,
            "machine": f"{platform.machine()}, {platform.system()}",
            "bodies": measure(url, model, args.repeat),
        }
    finally:
        if proc is not None:
            terminate(proc, timeout=10)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
