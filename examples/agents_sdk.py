"""An OpenAI Agents SDK agent through the luftpause gateway.

The SDK runs the loop; the luftpause headers ride on the `AsyncOpenAI` client it is given,
so every turn of the run carries them. The gateway speaks Chat Completions, hence
`OpenAIChatCompletionsModel` (an `Agent(model="...")` would use the Responses API).

    python examples/agents_sdk.py "Why does a paused run keep its replica?"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from typing import Annotated

import httpx
from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from openai import APIConnectionError, AsyncOpenAI, AuthenticationError

MODEL = "llama-3.2-1b"
BASE_URL = "http://127.0.0.1:8080/v1"
# The openai client insists on a key; a gateway without a token ignores it.
NO_TOKEN = "no-token"
MAX_TURNS = 10


# The descriptions given here, not in a docstring: the SDK reads them from one, and
# `python -OO` drops docstrings (the model would get the tool undescribed, silently).
@function_tool(description_override="Look something up in the team notes.")
def lookup(query: Annotated[str, "what to look up"]) -> str:
    # A canned answer, so the example needs no network beyond the gateway.
    return f"Notes on {query!r}: a paused run comes back, so its replica keeps room for it."


async def run(
    task: str,
    *,
    base_url: str = BASE_URL,
    token: str | None = None,
    service_class: str = "interactive",
    caller: str = "examples/agents_sdk",
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
        agent = Agent(
            name="notes",
            instructions="Answer the question; look things up in the team notes first.",
            tools=[lookup],
            model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        )
        # No tracing: the SDK would export its spans to OpenAI's servers.
        result = await Runner.run(
            agent, task, max_turns=MAX_TURNS, run_config=RunConfig(tracing_disabled=True)
        )
        # Done: the gateway may forget the run now rather than when it expires.
        await client.delete(f"/runs/{run_id}", cast_to=httpx.Response)
    return str(result.final_output), run_id


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
        "--caller", default=os.environ.get("LUFTPAUSE_CALLER", "examples/agents_sdk")
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
