"""An agent that keeps its own loop on the `openai` package, through the luftpause gateway.

The client sends the three luftpause headers on every turn (`default_headers`): one run id
for the whole run, so the gateway keeps its turns on the replica that holds its prefix;
the class; and the caller. When the run is done, it tells the gateway so (`DELETE
/v1/runs/{id}`) instead of leaving the run to expire.

    python examples/openai_loop.py "Why does a paused run keep its replica?"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from typing import Any

import httpx
from openai import APIConnectionError, AsyncOpenAI, AuthenticationError

MODEL = "llama-3.2-1b"
BASE_URL = "http://127.0.0.1:8080/v1"
# The openai client insists on a key; a gateway without a token ignores it.
NO_TOKEN = "no-token"
MAX_TURNS = 10

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look something up in the team notes.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look up"}},
                "required": ["query"],
            },
        },
    }
]


def lookup(query: str) -> str:
    """The one tool: a canned answer, so the example needs no network beyond the gateway."""
    return f"Notes on {query!r}: a paused run comes back, so its replica keeps room for it."


async def run(
    task: str,
    *,
    base_url: str = BASE_URL,
    token: str | None = None,
    service_class: str = "interactive",
    caller: str = "examples/openai_loop",
    run_id: str | None = None,
    model: str = MODEL,
) -> tuple[str, str]:
    """Run the agent on `task` until the model answers without tool calls; return the
    answer and the run id."""
    run_id = run_id or uuid.uuid4().hex
    headers = {
        "x-luftpause-run-id": run_id,
        "x-luftpause-class": service_class,
        "x-luftpause-caller": caller,
    }
    async with AsyncOpenAI(
        base_url=base_url, api_key=token or NO_TOKEN, default_headers=headers
    ) as client:
        answer = await agent_loop(client, task, model)
        # Done: the gateway may forget the run now rather than when it expires.
        await client.delete(f"/runs/{run_id}", cast_to=httpx.Response)
    return answer, run_id


async def agent_loop(client: AsyncOpenAI, task: str, model: str) -> str:
    """Call the model, run the tools it asks for, repeat until it answers."""
    messages: list[Any] = [{"role": "user", "content": task}]
    for _ in range(MAX_TURNS):
        completion = await client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS
        )
        message = completion.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.to_dict())
        for call in message.tool_calls:
            if call.type != "function" or call.function.name != "lookup":
                raise RuntimeError(f"the model called an unknown tool: {call}")
            result = lookup(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    raise RuntimeError(f"no answer after {MAX_TURNS} turns")


def main(argv: list[str] | None = None) -> int:
    # (No docstring under python -OO.)
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("task", nargs="?", default="What does luftpause do between turns?")
    parser.add_argument("--base-url", default=os.environ.get("LUFTPAUSE_BASE_URL", BASE_URL))
    parser.add_argument("--token", default=os.environ.get("LUFTPAUSE_TOKEN"))
    parser.add_argument(
        "--class",
        dest="service_class",
        choices=["interactive", "batch"],
        default=os.environ.get("LUFTPAUSE_CLASS", "interactive"),
    )
    parser.add_argument(
        "--caller", default=os.environ.get("LUFTPAUSE_CALLER", "examples/openai_loop")
    )
    parser.add_argument("--run-id", help="default: a fresh one")
    parser.add_argument("--model", default=MODEL)
    args = parser.parse_args(argv)
    try:
        answer, run_id = asyncio.run(
            run(
                args.task,
                base_url=args.base_url,
                token=args.token,
                service_class=args.service_class,
                caller=args.caller,
                run_id=args.run_id,
                model=args.model,
            )
        )
    # The two errors a first run meets, said in a line rather than a traceback.
    except AuthenticationError as exc:
        sys.exit(f"{args.base_url}: {exc}. Give the gateway's token: --token or LUFTPAUSE_TOKEN")
    except APIConnectionError as exc:
        said = str(exc).rstrip(".")
        sys.exit(f"{args.base_url}: {said}. Is the gateway running there? (`make up` starts one)")
    print(answer)
    print(f"run id: {run_id}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
