"""``kinference serve --handler rerank`` and ``--handler sparse`` as real processes on the real broker, compared with
sentence-transformers' own ``CrossEncoder.rank`` and ``SparseEncoder.encode`` on the same texts: one process, and a
worker beside a device process (``--device-process on --workers 1``)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kinference import protocol
from kinference.consumer.brokers.broker import free_port
from tests.faults.harness import Group, Member, Settings, client_for
from tests.faults.test_device_process import pids
from tests.faults.test_workers import get, wait_until
from tests.models import build_tiny_cross_encoder, build_tiny_sparse_encoder, varied_texts

# The reference: the `reference` extra, 6.2 (the lowest-versions run has 5.7, which the bundled MiniLM brings, on an
# older transformers: a tiny model initialises otherwise there, and these tests are for the reference they name).
pytest.importorskip("sentence_transformers", minversion="6.2",
                    reason="sentence-transformers 6.2 (pip install 'kinference[reference]') is the reference these "
                    "tests compare with")

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.model]

LONG = " ".join(["the broker sat on the mat"] * 40)  # past the tiny models' 128 positions: cut as they cut it
# Documents from one word to past the limit in each request; requests of about the same total tokens, so that the
# batcher's length groups (which see a request's total) put them in one batch.
RERANKS = [
    ("which partition holds the offset?", ["kafka", *varied_texts(2, seed=1, max_words=30), LONG]),
    ("blue river music", [LONG, *varied_texts(3, seed=2, max_words=20)]),
    ("a", [*varied_texts(2, seed=4, max_words=25), "a", LONG]),
]
TEXTS = ["kafka", *varied_texts(6, seed=3, max_words=70), LONG]


def served(settings: Settings, payloads: list[Any], *extra: str, device_process: bool = False) -> list[dict[str, Any]]:
    """Each payload's result from ``kinference serve`` with ``extra`` flags, all sent at once (so that they share
    batches), then a SIGTERM that must end the service with 0."""
    client = client_for(settings).start()
    try:
        with (_device_process if device_process else _one_process)(settings, *extra):
            futures = [client.send(payload, key=str(i)) for i, payload in enumerate(payloads)]
            replies = [future.result(90) for future in futures]
    finally:
        client.close()
    assert all(reply.ok for reply in replies), [reply.value for reply in replies]
    assert max(int(reply.headers[protocol.BATCH_SIZE]) for reply in replies) > 1, "requests should share batches"
    return [reply.result() for reply in replies]


@contextlib.contextmanager
def _one_process(settings: Settings, *extra: str) -> Iterator[None]:
    with Group(settings) as group:
        member = group.start(extra=extra)
        group.wait_stable(90)
        yield
        member.terminate()
        assert member.wait_exit(40) == 0


@contextlib.contextmanager
def _device_process(settings: Settings, *extra: str) -> Iterator[None]:
    port = free_port()
    args = [arg for arg in settings.args() if arg != "--no-metrics"]
    supervisor = Member("supervisor", [*args, *extra, "--device-process", "on", "--workers", "1",
                                       "--metrics-host", "127.0.0.1", "--metrics-port", str(port)])
    try:
        wait_until(lambda: get(port, "/readyz")[0] == 200 and "worker 0" in pids(supervisor), 120,
                   "the device process and the worker ready", supervisor)
        yield
        supervisor.terminate()
        assert supervisor.wait_exit(40) == 0
    finally:
        if supervisor.running:  # a failed test: its children may run on
            for pid in pids(supervisor).values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            supervisor.kill()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("device_process", [False, True], ids=["one-process", "device-process"])
def test_rerank_served_over_kafka_equals_cross_encoder_rank(fault_settings, tmp_path: Path,
                                                             device_process: bool) -> None:
    from sentence_transformers import CrossEncoder

    model = build_tiny_cross_encoder(tmp_path / "cross-encoder")
    payloads = [{"query": query, "documents": documents, "top_n": 4} for query, documents in RERANKS]
    results = served(fault_settings(partitions=1), payloads, "--handler", "rerank", "--model", str(model),
                     device_process=device_process)
    reference = CrossEncoder(str(model), device="cpu", local_files_only=True)
    for result, (query, documents) in zip(results, RERANKS, strict=True):
        expected = reference.rank(query, documents, top_k=4)
        assert [entry["index"] for entry in result["results"]] == [entry["corpus_id"] for entry in expected]
        scores = np.array([entry["relevance_score"] for entry in result["results"]])
        assert np.abs(scores - np.array([entry["score"] for entry in expected])).max() <= 1e-4


@pytest.mark.timeout(240)
@pytest.mark.parametrize("device_process", [False, True], ids=["one-process", "device-process"])
def test_sparse_served_over_kafka_equals_sparse_encoder_encode(fault_settings, tmp_path: Path,
                                                                device_process: bool) -> None:
    from sentence_transformers import SparseEncoder

    model = build_tiny_sparse_encoder(tmp_path / "sparse-encoder")
    payloads: list[Any] = [{"text": text} for text in TEXTS[:4]] + [{"input": TEXTS[4:]}]
    results = served(fault_settings(partitions=1), payloads, "--handler", "sparse", "--model", str(model),
                     device_process=device_process)
    vectors = [*results[:4], *results[4]["data"]]
    expected = SparseEncoder(str(model), device="cpu", local_files_only=True).encode(TEXTS).to_dense()
    for vector, row in zip(vectors, expected, strict=True):
        assert vector["indices"] == sorted(vector["indices"]) and len(vector["indices"]) >= 10
        dense = np.zeros(len(row), dtype=np.float32)
        dense[vector["indices"]] = vector["values"]
        assert np.abs(dense - row.numpy()).max() <= 1e-4
