"""A stdio MCP server whose one tool answers its own environment (tests of what a
stdio tool server is given)."""

import json
import os

from mcp.server.mcpserver import MCPServer

mcp: MCPServer = MCPServer("env")


@mcp.tool()
def environment() -> str:
    """The server's environment, as JSON."""
    return json.dumps(dict(os.environ))


if __name__ == "__main__":
    mcp.run("stdio")
