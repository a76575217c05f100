"""How qctl prints what services send: artifact ids whole, so that one can be pasted into the next command (the
gateway and the quantizer take only whole ids: a 12-character prefix is NOT_FOUND, and `qctl workers --artifact`
with one listed nothing), and enum values this qctl may not know."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Column

# Wide enough for any row qctl prints; a table is never wider than its content needs (rich's expand=False).
UNBOUNDED_WIDTH = 100_000


def table_console() -> Console:
    """The console for tables on stdout. On a terminal rich fits a table to its width. Written to a pipe or
    a file (`qctl ls > artifacts.txt`, `qctl ls | grep READY`) there is no width to fit, yet rich took 80
    columns and cut ids to 'aee7d3cd…': there the table is as wide as its content, unless COLUMNS says."""
    console = Console()
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(width=UNBOUNDED_WIDTH)


def id_column(header: str) -> Column:
    """A column of ids: in a terminal too narrow for the table they fold onto a second line, whole,
    instead of ending in an ellipsis."""
    return Column(header, overflow="fold")


def enum_label(enum, value: int, prefix: str) -> str:
    """An enum value's name without its prefix. A value this qctl does not know (a newer service's job stage or
    worker health) is UNKNOWN(n): Name() raised, and `qctl jobs list` or `qctl workers` failed with a traceback."""
    try:
        return enum.Name(value).removeprefix(prefix)
    except ValueError:
        return f"UNKNOWN({value})"
