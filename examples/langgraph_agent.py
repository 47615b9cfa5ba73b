"""A LangGraph agent through the luftpause gateway.

The graph is the usual tool loop: an `agent` node calls the model, `tools_condition`
routes its tool calls to a `ToolNode`, whose results go back to the model, until it
answers. The luftpause headers ride on the `ChatOpenAI` model (`default_headers`), so
every turn of the run carries them.

    python examples/langgraph_agent.py "Why does a paused run keep its replica?"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from typing import Any

import httpx
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from openai import APIConnectionError, AuthenticationError
from pydantic import SecretStr

MODEL = "llama-3.2-1b"
BASE_URL = "http://127.0.0.1:8080/v1"
# The openai client insists on a key; a gateway without a token ignores it.
NO_TOKEN = "no-token"
MAX_TURNS = 10
# A turn may be held a while before an engine takes it.
TIMEOUT_S = 600.0


# The description is given, not the docstring: python -OO drops docstrings, and @tool
# refused a function without one as the example was imported.
@tool(description="Look something up in the team notes.")
def lookup(query: str) -> str:
    # A canned answer, so the example needs no network beyond the gateway.
    return f"Notes on {query!r}: a paused run comes back, so its replica keeps room for it."


def build_graph(llm: ChatOpenAI) -> CompiledStateGraph[Any]:
    """agent → (tools → agent)* → end."""
    model = llm.bind_tools([lookup])

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([lookup]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


async def run(
    task: str,
    *,
    base_url: str = BASE_URL,
    token: str | None = None,
    service_class: str = "interactive",
    caller: str = "examples/langgraph_agent",
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
    # Our own HTTP client, closed with the run (ChatOpenAI's default one is shared
    # process-wide); it also ends the run.
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
        llm = ChatOpenAI(
            model=model,
            base_url=base_url,
            api_key=SecretStr(token or NO_TOKEN),
            default_headers=headers,
            http_async_client=http,
            use_responses_api=False,  # the gateway speaks Chat Completions
        )
        # Each turn is two steps of the graph (agent, tools).
        state = await build_graph(llm).ainvoke(
            {"messages": [("user", task)]}, {"recursion_limit": 2 * MAX_TURNS}
        )
        # Done: the gateway may forget the run now rather than when it expires.
        auth = {"authorization": f"Bearer {token or NO_TOKEN}"}
        ended = await http.delete(f"{base_url.rstrip('/')}/runs/{run_id}", headers=auth)
        ended.raise_for_status()
    return state["messages"][-1].text, run_id


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
        "--caller", default=os.environ.get("LUFTPAUSE_CALLER", "examples/langgraph_agent")
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
