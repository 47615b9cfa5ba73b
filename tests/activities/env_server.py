"""A stdio MCP server whose tools answer its own environment and process id (tests of
what a stdio tool server is given, and of one that dies)."""

import json
import os

from mcp.server.mcpserver import MCPServer

mcp: MCPServer = MCPServer("env")


@mcp.tool()
def environment() -> str:
    """The server's environment, as JSON."""
    return json.dumps(dict(os.environ))


@mcp.tool()
def pid() -> str:
    """The server's process id."""
    return str(os.getpid())


if __name__ == "__main__":
    mcp.run("stdio")
