"""The ``kinference`` command: one entry point that hands each subcommand to the module that owns it.

Nothing beyond the standard library is imported until the subcommand is known, so ``kinference --version``
and ``kinference --help`` work on the base install, and a subcommand whose extra is missing says which one
to install instead of failing with a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from kinference import __version__


@dataclass(frozen=True)
class Command:
    module: str
    extras: str
    """What ``pip install 'kinference[...]'`` the command needs."""
    help: str
    takes_name: bool = False
    """The module's ``main`` parses the command name itself (it owns several commands)."""


COMMANDS = {
    "serve": Command("kinference.consumer.ops.cli", "serve", "run the inference service", takes_name=True),
    "topics": Command("kinference.consumer.ops.cli", "serve",
                      "create the service's topics, with the same Kafka settings as serve", takes_name=True),
    "healthcheck": Command("kinference.consumer.ops.cli", "serve",
                           "probe /healthz of a running serve (the container health check)", takes_name=True),
    "broker": Command("kinference.consumer.ops.cli", "serve,embedded",
                      "run the embedded Tansu broker for local development", takes_name=True),
    "loadgen": Command("kinference.loadgen.cli", "loadgen", "drive load at a running service and report"),
    "demo": Command("kinference.loadgen.demo", "serve,loadgen,embedded",
                    "broker + service + bundled model + load sweep, one command"),
    "bench": Command("kinference.loadgen.bench.bench", "serve,loadgen,embedded",
                     "every scenario side by side on one embedded broker"),
    "drain": Command("kinference.loadgen.bench.drain", "serve,loadgen,embedded",
                     "how fast each contender drains a backlog, and where its time goes"),
    "cpu-paths": Command("kinference.loadgen.bench.cpu_paths", "serve,loadgen,embedded,onnx",
                         "the embedding handler's CPU options side by side: speed and cosine to float32"),
}


def build_parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<12} {command.help}" for name, command in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="kinference",
        description="Kafka-native streaming inference.",
        usage="kinference [--version] COMMAND [ARGS...]",
        epilog=f"commands:\n{listing}\n\n'kinference COMMAND --help' describes each.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kinference {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-"):
        parser.parse_args(argv)  # --help and --version exit here
        parser.error("a command is required")
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        parser.error(f"unknown command {name!r} (choose from {', '.join(COMMANDS)})")
    try:
        module = importlib.import_module(command.module)
        code: int = module.main(argv if command.takes_name else rest)
        return code
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "kinference":
            raise  # a bug of ours, not a missing extra
        print(f"kinference {name}: the module {exc.name!r} is not installed; this command needs "
              f"pip install 'kinference[{command.extras}]'", file=sys.stderr)
        return 2
