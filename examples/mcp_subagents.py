"""Sub-agents through the luftpause MCP door, on the official `mcp` client.

It lists the door's tools, spawns two runs, awaits both, and prints each answer whole:
an answer longer than the await's share of `maxChars` comes cut, and the rest is read
with the `answer` tool from `answerNextOffset`.  A run that failed or was cancelled (its
budget, a cancel) has no answer: its `error` says why.  A run that waits for the user's
approval of a tool call (`approveTools`) is not awaited further: its pending call is
printed, for the `approve` tool to answer (where the gateway withholds it, `[mcp]
approve_tool = false`, the user in a client that shows forms) or `cancel` to end.

    python examples/mcp_subagents.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

URL = "http://127.0.0.1:8080/mcp"
TASKS: list[dict[str, Any]] = [
    # `make up`'s fake engines make 0-3 tool calls, as the task's text hashes: this one
    # makes 2 (its wording before helper-250 made none, and the run never used lookup).
    {"task": "Look up why a paused run keeps its replica, then answer.", "tools": ["lookup"]},
    # `[fake: long]` asks `make up`'s fake engines for a 1,024-token answer (a real model
    # reads it as part of the task); maxTokens leaves it room.
    {"task": "Write a long report on agent runs. [fake: long]", "tools": [], "maxTokens": 2048},
]


async def call(client: Client, tool: str, arguments: dict[str, Any]) -> Any:
    result = await client.call_tool(tool, arguments)
    if result.is_error:
        raise RuntimeError(f"{tool}: {result.content}")
    return result.structured_content


async def unauthorized(response: httpx2.Response) -> None:
    """Raise a 401 as itself: the MCP client would say only "Server returned an error
    response"."""
    if response.status_code == 401:
        response.raise_for_status()


async def run(url: str = URL, token: str | None = None, caller: str = "examples/mcp") -> None:
    headers = {"x-luftpause-caller": caller}
    if token:
        headers["authorization"] = f"Bearer {token}"
    # No read timeout: `await` holds its call open up to its own `timeout`.
    http = httpx2.AsyncClient(
        headers=headers,
        timeout=httpx2.Timeout(30.0, read=None),
        event_hooks={"response": [unauthorized]},
    )
    async with http, Client(streamable_http_client(url, http_client=http)) as client:
        listed = await client.list_tools()
        print("tools:", ", ".join(t.name for t in listed.tools))
        # Not listed where the operator wants approvals from people only.
        can_approve = any(t.name == "approve" for t in listed.tools)
        handles = [(await call(client, "spawn", spec))["handle"] for spec in TASKS]
        shown: dict[str, Any] = {}
        waited, done = handles, False
        while waited and not done:  # `await` gives back what has ended after its timeout
            args = {"handles": waited, "timeout": 60, "maxChars": 1000}
            awaited = await call(client, "await", args)
            done = awaited["done"]
            shown |= {r["handle"]: r for r in awaited["runs"]}
            # A run waiting for the user's approval of a tool call (a tool in its
            # `approveTools`) moves only once someone answers: not waited for again.
            waited = [r["handle"] for r in awaited["runs"] if r["state"] != "AwaitingApproval"]
        for r in (shown[h] for h in handles):
            # (A field that is null is left out: no answer yet, or an answer whole.)
            answer, offset = r.get("answer") or "", r.get("answerNextOffset")
            while offset is not None:  # the rest, a page at a time
                page = await call(client, "answer", {"handle": r["handle"], "offset": offset})
                answer, offset = answer + page["text"], page["nextOffset"]
            print(f"{r['handle']} {r['state']}, {r['toolCalls']} tool calls:")
            if answer:
                print(answer)
            if "error" in r:  # why it failed or was cancelled (a budget, a cancel)
                # (Cut to its share of maxChars: `status` of the run shows it whole.)
                cut = f" ... ({r['errorChars']} characters in all)" if "errorChars" in r else ""
                print(f"error: {r['error']}{cut}")
            if r["state"] == "AwaitingApproval":
                p = r["pendingApproval"]
                how = (
                    "answer it with the `approve` tool"
                    if can_approve
                    else "they answer it in a client that shows forms (its `await` of the "
                    "run asks them)"
                )
                print(
                    f"approval: {p['tool']} (callId {p['callId']}) waits for the user: "
                    f"{how}, or end the run with `cancel`"
                )


def main(argv: list[str] | None = None) -> int:
    # (No docstring under python -OO.)
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("LUFTPAUSE_MCP_URL", URL))
    parser.add_argument("--token", default=os.environ.get("LUFTPAUSE_TOKEN"))
    parser.add_argument("--caller", default=os.environ.get("LUFTPAUSE_CALLER", "examples/mcp"))
    args = parser.parse_args(argv)
    try:
        asyncio.run(run(args.url, args.token, args.caller))
    # The two errors a first run meets, said in a line rather than a traceback (the MCP
    # client's task groups wrap them: except*).
    except* httpx2.HTTPStatusError:
        sys.exit(
            f"{args.url}: 401, no token or a wrong one. Give the gateway's token: "
            "--token or LUFTPAUSE_TOKEN"
        )
    except* httpx2.ConnectError:
        sys.exit(
            f"{args.url}: cannot connect. Is the gateway running there? (`make up` starts one)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
