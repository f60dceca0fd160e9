"""The report files that ``bench``, ``drain`` and ``cpu-paths`` write: the JSON report and its Markdown tables."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--markdown", type=Path, help="write the tables as Markdown here")


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))


def write_reports(report: dict[str, Any], args: argparse.Namespace,
                  markdown: Callable[[dict[str, Any]], str]) -> list[Path]:
    """Write the files ``--out`` and ``--markdown`` asked for; return their paths."""
    written = []
    if args.out:
        write_json(report, args.out)
        written.append(args.out)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(report))
        written.append(args.markdown)
    return written
