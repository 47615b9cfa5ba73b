"""An agent that keeps its own loop on the `anthropic` package, through the luftpause
gateway's Anthropic Messages door (`/v1/messages`, the API Claude Code speaks).

As `openai_loop.py`: the three luftpause headers on every turn (`default_headers`), and
the run ended when it is done (`DELETE /v1/runs/{id}`).  The gateway passes the turns to
engines that serve `/v1/messages` themselves (vLLM, SGLang, llama.cpp, Ollama).

    python examples/anthropic_loop.py "Why does a paused run keep its replica?"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from collections.abc import Mapping
from typing import Any

from anthropic import APIConnectionError, AsyncAnthropic, AuthenticationError

MODEL = "llama-3.2-1b"
# The Anthropic client adds /v1/messages itself: the gateway's root.
BASE_URL = "http://127.0.0.1:8080"
# The anthropic client insists on a key; a gateway without a token ignores it.
NO_TOKEN = "no-token"
MAX_TURNS = 10
MAX_TOKENS = 512

TOOLS: list[Any] = [
    {
        "name": "lookup",
        "description": "Look something up in the team notes.",
        "input_schema": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look up"}},
            "required": ["query"],
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
    caller: str = "examples/anthropic_loop",
    run_id: str | None = None,
    model: str = MODEL,
) -> tuple[str, str]:
    """Run the agent on `task` until the model answers without tool use; return the
    answer and the run id."""
    run_id = run_id or uuid.uuid4().hex
    headers = {
        "x-luftpause-run-id": run_id,
        "x-luftpause-class": service_class,
        "x-luftpause-caller": caller,
    }
    # The gateway takes its token on this door as a bearer token or in x-api-key.
    async with AsyncAnthropic(
        base_url=base_url, api_key=token or NO_TOKEN, default_headers=headers
    ) as client:
        answer = await agent_loop(client, task, model)
        # Done: the gateway may forget the run now rather than when it expires.
        await client.delete(f"/v1/runs/{run_id}", cast_to=type(None))
    return answer, run_id


async def agent_loop(client: AsyncAnthropic, task: str, model: str) -> str:
    """Call the model, run the tools it asks for, repeat until it answers."""
    messages: list[Any] = [{"role": "user", "content": task}]
    for _ in range(MAX_TURNS):
        message = await client.messages.create(
            model=model, max_tokens=MAX_TOKENS, messages=messages, tools=TOOLS
        )
        if message.stop_reason != "tool_use":
            return "".join(block.text for block in message.content if block.type == "text")
        messages.append({"role": "assistant", "content": message.content})
        results = []
        for block in message.content:
            if block.type != "tool_use":
                continue
            if block.name != "lookup" or not isinstance(block.input, dict):
                raise RuntimeError(f"the model called an unknown tool: {block}")
            content = lookup(str(block.input.get("query", "")))
            results.append({"type": "tool_result", "tool_use_id": block.id, "content": content})
        messages.append({"role": "user", "content": results})
    raise RuntimeError(f"no answer after {MAX_TURNS} turns")


def _base_url(env: Mapping[str, str]) -> str:
    """LUFTPAUSE_ANTHROPIC_BASE_URL, else the other examples' LUFTPAUSE_BASE_URL without
    its /v1 (the Anthropic SDK adds /v1/messages itself), else the default."""
    if url := env.get("LUFTPAUSE_ANTHROPIC_BASE_URL"):
        return url
    if url := env.get("LUFTPAUSE_BASE_URL"):
        return url.rstrip("/").removesuffix("/v1")
    return BASE_URL


def main(argv: list[str] | None = None) -> int:
    # (No docstring under python -OO.)
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("task", nargs="?", default="What does luftpause do between turns?")
    parser.add_argument("--base-url", default=_base_url(os.environ))
    parser.add_argument("--token", default=os.environ.get("LUFTPAUSE_TOKEN"))
    parser.add_argument(
        "--class",
        dest="service_class",
        choices=["interactive", "batch"],
        default=os.environ.get("LUFTPAUSE_CLASS", "interactive"),
    )
    parser.add_argument(
        "--caller", default=os.environ.get("LUFTPAUSE_CALLER", "examples/anthropic_loop")
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
