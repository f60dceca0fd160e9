"""What the benchmark commands show and write: titled tables on the console, and the report files (the JSON
report and its Markdown tables)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from rich import box
from rich.console import Console
from rich.table import Table

Titled = list[tuple[str, list[str], list[list[str]]]]
"""(title, header, rows) of each table of a report."""


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


def print_tables(titled: Titled, console: Console) -> None:
    """(title, header, rows) tables on the console: the first column and free text left, numbers right."""
    for title, header, rows in titled:
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        wrap = {"target", "detail"}
        for index, name in enumerate(header):
            table.add_column(name, justify="left" if index == 0 or name in wrap else "right",
                             no_wrap=name not in wrap)
        for row in rows:
            table.add_row(*row)
        console.print(table)


def tables_markdown(report: dict[str, Any], titled: Titled) -> str:
    """A run's header line (command, machine, wall time, load) and its (title, header, rows) tables in Markdown."""
    machine = report["machine"]
    broker = report.get("broker", {}).get("description")
    lines = [f"`{report['command']}`, {report['started']}, {machine['cpus']} CPUs ({machine['cpu']}), "
             f"torch {machine['torch']}, {f'broker {broker}, ' if broker else ''}wall time {report['wall_s']:.0f} s, "
             "load average "
             f"{machine['loadavg_start']} before / {machine['loadavg_end']} after.", ""]
    for title, header, rows in titled:
        lines += [f"**{title}**", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)
