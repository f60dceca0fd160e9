"""``kinference cpu-paths``: the embedding handler's CPU options side by side, for speed and for accuracy.

Each variant is the embedding handler set up with some handler options (``torch``: the defaults; ``onnxruntime``:
``runtime=onnxruntime``; ``onnxruntime-int8``: plus ``quantize=int8``; ``torch-compile``: ``compile=true``, opt in,
it compiles every shape bucket first, minutes on a small CPU). All of them embed the same corpus, batched in
length order (the in-process grouped ceiling of ``kinference bench``), in interleaved rounds so that machine
noise hits each alike. Reported per variant: items per second (best round, and the ratio to ``torch`` in the
same round), and the cosine similarity of its embeddings to ``torch``'s float32 ones (mean and worst).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from kinference.loadgen.bench.ceiling import CUT
from kinference.loadgen.bench.outputs import add_report_arguments, write_reports
from kinference.loadgen.corpus import PROFILES, builtin_corpus

VARIANTS: dict[str, dict[str, Any]] = {
    "torch": {},
    "onnxruntime": {"runtime": "onnxruntime"},
    "onnxruntime-int8": {"runtime": "onnxruntime", "quantize": "int8"},
    "torch-compile": {"compile": True},
}
DEFAULT_VARIANTS = ("torch", "onnxruntime", "onnxruntime-int8")


def measure(variants: Sequence[str], texts: Sequence[str], batch_size: int, rounds: int,
            console: Console) -> dict[str, Any]:
    import torch

    from kinference.handlers import HandlerContext
    from kinference.handlers.embedding import EmbeddingHandler

    ordered = sorted(texts, key=len)
    handlers = {}
    for name in ("torch", *[v for v in variants if v != "torch"]):
        console.print(f"setting up {name}")
        started = time.monotonic()
        handler = EmbeddingHandler()
        handler.setup(HandlerContext(device="cpu", options=VARIANTS[name], max_batch_size=batch_size))
        handler.warm_up()
        handlers[name] = (handler, round(time.monotonic() - started, 1))
    batches = {name: [handler.preprocess([handler.validate({"text": t, **CUT}) for t in ordered[i:i + batch_size]])
                      for i in range(0, len(ordered), batch_size)] for name, (handler, _) in handlers.items()}
    rates: dict[str, list[float]] = {name: [] for name in handlers}
    outputs: dict[str, torch.Tensor] = {}
    for index in range(rounds):
        for name, (handler, _) in handlers.items():
            started = time.perf_counter()
            rows = [handler.inference(batch) for batch in batches[name]]
            rates[name].append(len(ordered) / (time.perf_counter() - started))
            outputs[name] = torch.cat(rows)
            console.print(f"round {index + 1}: {name} {rates[name][-1]:,.1f} items/s")
    reference = outputs["torch"]
    results = []
    for name, (handler, setup_s) in handlers.items():
        cosine = torch.nn.functional.cosine_similarity(outputs[name], reference, dim=1)
        ratios = [mine / base for mine, base in zip(rates[name], rates["torch"], strict=True)]
        results.append({"variant": name, "options": VARIANTS[name], "setup_s": setup_s,
                        "items_per_s": round(max(rates[name]), 1), "rounds": [round(r, 1) for r in rates[name]],
                        "ratio_to_torch": round(statistics.median(ratios), 3),
                        "cosine_mean": round(cosine.mean().item(), 5), "cosine_min": round(cosine.min().item(), 5)})
        handler.close()
    return {"command": "kinference cpu-paths", "texts": len(ordered), "batch_size": batch_size, "rounds": rounds,
            "torch_threads": torch.get_num_threads(), "cores": os.cpu_count(), "variants": results}


def table(report: dict[str, Any]) -> Table:
    out = Table(title=f"CPU paths: {report['texts']} texts, batches of {report['batch_size']}, "
                      f"{report['rounds']} rounds", box=box.SIMPLE_HEAVY)
    for column in ("variant", "items/s", "x torch", "cosine mean", "cosine min", "setup s"):
        out.add_column(column, justify="left" if column == "variant" else "right")
    for row in report["variants"]:
        out.add_row(row["variant"], f"{row['items_per_s']:,.1f}", f"{row['ratio_to_torch']:.2f}",
                    f"{row['cosine_mean']:.4f}", f"{row['cosine_min']:.4f}", f"{row['setup_s']:g}")
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = ["| variant | handler options | items/s | x torch (median round) | cosine to float32 mean | min |",
             "|---|---|---|---|---|---|"]
    for row in report["variants"]:
        options = " ".join(f"{k}={v}" for k, v in row["options"].items()) or "(defaults)"
        lines.append(f"| {row['variant']} | `{options}` | {row['items_per_s']:,.1f} | {row['ratio_to_torch']:.2f} "
                     f"| {row['cosine_mean']:.4f} | {row['cosine_min']:.4f} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kinference cpu-paths", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", type=lambda text: tuple(text.split(",")), default=DEFAULT_VARIANTS,
                        metavar="NAME,...", help=f"of {', '.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--texts", type=int, default=1024, help="corpus size (default: %(default)s)")
    parser.add_argument("--corpus", choices=sorted(PROFILES), default="mixed")
    parser.add_argument("--batch-size", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    add_report_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(sorted(unknown))}; known: {', '.join(VARIANTS)}")
    if args.rounds < 1 or args.texts < 1 or args.batch_size < 1:
        parser.error("--rounds, --texts and --batch-size must be at least 1")
    console = Console()
    texts = [payload["text"] for payload in builtin_corpus(args.corpus, size=args.texts)]
    report = measure(args.variants, texts, args.batch_size, args.rounds, console)
    console.print(table(report))
    write_reports(report, args, markdown)
    return 0
