"""The tool activity against a real MCP server over loopback: what reaches the model."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field
from temporalio.testing import ActivityEnvironment

from activities import ToolActivities, ToolInput
from activities.mcp_pool import McpPool
from activities.tools import TOOL_OUTPUT_MAX_CHARS
from luftpause.config import McpServer
from testkit.loopback import serve


def _server() -> MCPServer:
    mcp: MCPServer = MCPServer("sizes")
    calls: list[int] = []

    @mcp.tool()
    async def page(chars: Annotated[int, Field(ge=0)]) -> str:
        """A document of this many characters, as a fetch of a large page answers."""
        calls.append(chars)
        return "é" * chars

    mcp.calls = calls  # type: ignore[attr-defined]
    return mcp


async def test_a_long_answer_is_cut_with_a_note_and_a_short_one_is_kept() -> None:
    server = _server()
    app = server.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    async with serve(app) as url:
        pool = McpPool([McpServer(name="s", url=f"{url}/mcp")])
        tools = ToolActivities(pool)
        env = ActivityEnvironment()
        try:
            schema = (await env.run(tools.list_tools))[0].input_schema

            def call(chars: int) -> ToolInput:
                args = f'{{"chars": {chars}}}'
                return ToolInput(run_id="r", server="s", tool="page", arguments=args,
                                 input_schema=schema, call_id=f"c{chars}")  # fmt: skip

            short = await env.run(tools.call_tool, call(TOOL_OUTPUT_MAX_CHARS))
            assert short.content == "é" * TOOL_OUTPUT_MAX_CHARS and not short.is_error
            # 3 MB of UTF-8: uncut, past Temporal's 2 MB payload limit, the activity
            # would fail after the call ran, and every retry would run it again.
            long = await env.run(tools.call_tool, call(1_500_000))
            assert long.content.startswith("é" * TOOL_OUTPUT_MAX_CHARS + "\n[luftpause: ")
            assert long.content.endswith("cut to its first 100,000 of 1,500,000 characters]")
            assert len(long.content.encode()) < 2 * TOOL_OUTPUT_MAX_CHARS + 200
            assert long.executed and not long.is_error
            assert server.calls == [TOOL_OUTPUT_MAX_CHARS, 1_500_000]  # type: ignore[attr-defined]
        finally:
            await pool.aclose()
