"""A stdio "MCP server" that never answers `initialize`: it writes its PID to the file
named by its argument and waits until its stdin closes."""

import os
import sys
from pathlib import Path

Path(sys.argv[1]).write_text(str(os.getpid()))
sys.stdin.read()
