"""Temporal activities: where sub-agent runs touch the world (the gateway, MCP servers).

Workflows import the contract types and activity classes from here; activities import
nothing from workflows or the worker.
"""

from activities.contract import (
    EndRunInput,
    ToolCall,
    ToolInfo,
    ToolInput,
    ToolOutput,
    TurnInput,
    TurnOutput,
)
from activities.llm import LlmActivities
from activities.tools import ToolActivities

__all__ = [
    "EndRunInput",
    "LlmActivities",
    "ToolActivities",
    "ToolCall",
    "ToolInfo",
    "ToolInput",
    "ToolOutput",
    "TurnInput",
    "TurnOutput",
]
