"""A stdio MCP server whose tools have names engines refuse as function names (tests of
the names a run's model is offered): dots, a slash, a digit first, 70 characters."""

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

mcp: MCPServer = MCPServer("named")
LONG = "synchronize_all_customer_records_across_every_connected_billing_system"


@mcp.tool(name="files.read", annotations=ToolAnnotations(read_only_hint=True))
def read(path: str) -> str:
    """Read a file."""
    return f"contents of {path}"


@mcp.tool(name="files/delete", annotations=ToolAnnotations(destructive_hint=True))
def delete(path: str) -> str:
    """Delete a file."""
    return f"deleted {path}"


@mcp.tool(name="2fa-check", annotations=ToolAnnotations(read_only_hint=True))
def check(code: str) -> str:
    """Check a code."""
    return f"checked {code}"


@mcp.tool(name=LONG, annotations=ToolAnnotations(read_only_hint=True))
def synchronize() -> str:
    """Synchronize."""
    return "synchronized"


@mcp.tool(name="files_read", annotations=ToolAnnotations(read_only_hint=True))
def read_too(path: str) -> str:
    """Read a file, by the name `files.read` would be given."""
    return f"also {path}"


if __name__ == "__main__":
    mcp.run("stdio")
