"""argparse types shared by the command-line tools (kept apart from ``cli`` so that the
subcommands' modules can use them without importing ``cli``)."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value
