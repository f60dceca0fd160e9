"""What the benchmark commands' ``main`` functions share: options from the command line, and a run that fails
with one line on the console instead of a traceback."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rich.console import Console

from kinference.errors import KinferenceError
from kinference.loadgen.bench.contender import setup_logging
from kinference.loadgen.errors import ClientError

Options = TypeVar("Options")


def parse_options(parser: argparse.ArgumentParser, argv: Sequence[str],
                  build: Callable[[argparse.Namespace], Options]) -> tuple[argparse.Namespace, Options]:
    """``argv`` parsed, and the run's options built from it; a ValueError from ``build`` is a usage error (it
    exits, as argparse does)."""
    args = parser.parse_args(argv)
    try:
        return args, build(args)
    except ValueError as exc:
        parser.error(str(exc))


def measured(command: str, run: Callable[[Console], dict[str, Any]]) -> tuple[Console, dict[str, Any] | None]:
    """``run``'s report, on a new console, with logging set up as in each contender's process; no report when it
    failed (the broker, a contender or the client), which the console says in one line."""
    setup_logging()
    console = Console()
    try:
        return console, run(console)
    except (KinferenceError, ClientError, RuntimeError) as exc:
        console.print(f"[red]{command} failed: {exc}[/red]")
        return console, None
