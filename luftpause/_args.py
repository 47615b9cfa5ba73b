"""Argument types the subcommands share: argparse says which flag and value were wrong."""

from __future__ import annotations

import argparse
import math


def port(text: str) -> int:
    """A TCP port to listen on: 1 to 65535 (0 would bind a port nobody is told)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port 1-65535, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 1-65535, got {value}")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number), got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected finite seconds >= 0, got {text!r}")
    return value


def positive(text: str) -> float:
    """A finite number greater than 0 (a time scale)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value
