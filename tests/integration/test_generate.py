"""A generative model served through Kafka: OpenAI bodies in, chat.completion finals and chat.completion.chunk
stream records out, on one partition per request, committed only once answered."""

from __future__ import annotations

import time

import orjson
import pytest

from kinference import protocol
from kinference.consumer.service import Service
from tests.integration.kafka_io import committed, headers_of, produce, read, service_config
from tests.models import build_tiny_causal_lm

pytestmark = [pytest.mark.integration, pytest.mark.model]


def test_generate_streams_chunks_then_one_final_per_request(broker, tmp_path):
    topics = broker.topics(requests=2, replies=3, dead=1)
    model_dir = build_tiny_causal_lm(tmp_path / "lm")
    chat = {"messages": [{"role": "user", "content": "hello kafka"}], "max_tokens": 20, "temperature": 0}
    records = [
        (None, orjson.dumps({**chat, "stream": True}), [(protocol.CORRELATION_ID, b"streamed")]),
        (b"k", orjson.dumps({"prompt": "the cat sat", "max_tokens": 5}), [(protocol.CORRELATION_ID, b"plain")]),
        (b"p", b"not json", [(protocol.CORRELATION_ID, b"poison")]),
        (b"d", orjson.dumps({**chat, "max_tokens": 200, "stream": True}),
         [(protocol.CORRELATION_ID, b"late"), (protocol.DEADLINE_MS, str(int(time.time() * 1000) + 60_000).encode())]),
        (b"x", orjson.dumps({"prompt": "cat " * 300}), [(protocol.CORRELATION_ID, b"too-long")]),
    ]
    config = service_config(broker.bootstrap_servers, topics, handler="generate", model=model_dir,
                            handler_options={"decoding": "greedy", "max_new_tokens": 200},
                            stream_every_tokens=4, stream_every_ms=10_000)
    with Service(config) as service:
        assert service.wait_ready(60)
        produce(broker.bootstrap_servers, topics["requests"], records)
        finals = _finals(broker.bootstrap_servers, topics["replies"], 5)
        group = config.group_id
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every request answered: the commit passes all five
            offsets = committed(broker.bootstrap_servers, group, [(topics["requests"], p) for p in range(2)])
            if sum(max(offset, 0) for offset in offsets.values()) == len(records):
                break
            time.sleep(0.2)
        assert sum(max(offset, 0) for offset in offsets.values()) == len(records)
        tokens = service.metrics.registry.get_sample_value("kinference_generated_tokens_total",
                                                           {"model": service.models.loaded[0].name})
    everything = read(broker.bootstrap_servers, topics["replies"], 0, timeout_s=5, settle_s=2)
    by_id: dict[bytes, list] = {}
    for message in everything:
        by_id.setdefault(headers_of(message)[protocol.CORRELATION_ID], []).append(message)

    # The poison and the over-long prompt fail alone, with the usual error replies.
    assert orjson.loads(finals[b"poison"].value())["error"]["code"] == "bad_request"
    assert "context" in orjson.loads(finals[b"too-long"].value())["error"]["message"]

    plain = orjson.loads(finals[b"plain"].value())
    assert plain["object"] == "chat.completion" and plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == 5
    assert len(by_id[b"plain"]) == 1  # no "stream": the final only

    for name in (b"streamed", b"late"):
        messages = by_id[name]
        assert len({m.partition() for m in messages}) == 1, "one request's records share one partition"
        headers = [headers_of(m) for m in messages]
        assert [h[protocol.SEQUENCE] for h in headers] == [str(i).encode() for i in range(len(messages))]
        assert len({h[protocol.ATTEMPT] for h in headers}) == 1
        assert [h[protocol.EVENT] for h in headers] == [b"delta"] * (len(messages) - 1) + [b"final"]
        chunks = [orjson.loads(m.value()) for m in messages[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        final = orjson.loads(messages[-1].value())
        text = final["choices"][0]["message"]["content"]
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == text
        assert len(chunks) >= 2, "the first chunk goes at once, then every 4 tokens"
    assert tokens is not None and tokens >= 5


def _finals(bootstrap: str, topic: str, count: int) -> dict[bytes, object]:
    """The final (or error) record of each correlation id, once ``count`` of them arrived."""
    deadline = time.monotonic() + 120
    finals: dict[bytes, object] = {}
    while len(finals) < count and time.monotonic() < deadline:
        for message in read(bootstrap, topic, 0, timeout_s=2, settle_s=1):
            headers = headers_of(message)
            if headers.get(protocol.EVENT) != b"delta":
                finals[headers[protocol.CORRELATION_ID]] = message
    assert len(finals) == count, sorted(finals)
    return finals


def test_client_stream_yields_the_deltas_in_order_and_the_completion(broker, tmp_path):
    from kinference.loadgen.client import Client

    topics = broker.topics(requests=2, replies=2, dead=1)
    config = service_config(broker.bootstrap_servers, topics, handler="generate",
                            model=build_tiny_causal_lm(tmp_path / "lm"),
                            handler_options={"decoding": "greedy"}, stream_every_tokens=2)
    body = {"messages": [{"role": "user", "content": "tell me about kafka"}], "max_tokens": 16}
    with Service(config) as service:
        assert service.wait_ready(60)
        with Client(broker.bootstrap_servers, topics["requests"], topics["replies"], timeout_s=60,
                    reply_consumer={"fetch.wait.max.ms": "10"}) as client:
            streamed = client.stream(body)
            deltas = list(streamed)
            plain = client.request(body).result()  # the same body, not streamed: the final only
    assert len(deltas) >= 2 and not any(delta.restart for delta in deltas)
    text = "".join(delta.text for delta in deltas)
    assert streamed.completion is not None and text == streamed.completion["choices"][0]["message"]["content"]
    assert plain["choices"][0]["message"]["content"] == text  # greedy: the same tokens


def test_the_control_reader_hands_over_each_cancel_from_every_partition(broker):
    """Cancels written after the reader started reach it from any partition; older ones are not replayed."""
    from kinference.consumer.path.control import ControlReader

    topics = broker.topics(requests=1, replies=1, dead=1, control=3)
    produce(broker.bootstrap_servers, topics["control"], [(None, b'{"cancel": "old"}', [])])
    config = service_config(broker.bootstrap_servers, topics)
    seen: list[str] = []
    reader = ControlReader(config.consumer_config(), topics["control"], seen.append)
    reader.start()
    try:
        time.sleep(1.0)  # the assignment at the end takes effect
        produce(broker.bootstrap_servers, topics["control"],
                [(str(i).encode(), orjson.dumps({"cancel": f"c{i}"}), []) for i in range(6)] + [(None, b"junk", [])])
        deadline = time.monotonic() + 30
        while len(seen) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        reader.stop()
    assert sorted(seen) == [f"c{i}" for i in range(6)]


def test_loadgen_generative_reports_tokens_time_to_first_chunk_and_finished_counts(broker, tmp_path):
    """``kinference loadgen --generative`` against a generate service: every generation finished, with its tokens,
    time to first chunk and times between chunks in the report and the plot."""
    from kinference.loadgen import cli

    topics = broker.topics(requests=2, replies=2, dead=1)
    config = service_config(broker.bootstrap_servers, topics, handler="generate",
                            model=build_tiny_causal_lm(tmp_path / "lm"),
                            handler_options={"decoding": "greedy"}, stream_every_tokens=2)
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    with Service(config) as service:
        assert service.wait_ready(60)
        assert cli.main(["--bootstrap-servers", broker.bootstrap_servers, "--request-topic", topics["requests"],
                         "--reply-topic", topics["replies"], "--no-progress", "--kafka", "fetch.wait.max.ms=10",
                         "--generative", "--max-tokens", "8", "--sweep-concurrency", "1,4", "--requests", "8",
                         "--warmup", "0.5", "--out", str(out), "--plot", str(plot)]) == 0
    runs = orjson.loads(out.read_bytes())["runs"]
    assert [run["concurrency"] for run in runs] == [1, 4]
    for run in runs:
        generation = run["generation"]
        assert run["ok"] == run["sent"] == 8 and run["lost"] == 0
        assert (generation["finished"], generation["aborted"]) == (8, 0)
        assert set(generation["finish_reasons"]) <= {"stop", "length"} and generation["restarts"] == 0
        assert 8 <= generation["tokens"] <= 8 * 8 and generation["tokens_per_s"] > 0
        ttfc = generation["ttfc_ms"]
        assert 0 < ttfc["p50"] <= ttfc["max"] < run["latency_ms"]["max"]
    assert any(run["generation"]["between_chunks_ms"]["p50"] for run in runs)  # chunks of 2 tokens: several a request
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_under_exactly_once_a_stream_is_its_final_alone_in_the_transaction(broker, tmp_path):
    """The delivery mode decides which records a generation writes (issue 37): exactly-once's makes no chunks, so a
    ``"stream": true`` request gets one record, its final, sequence 0, committed with its offset."""
    topics = broker.topics(requests=1, replies=2, dead=1)
    model_dir = build_tiny_causal_lm(tmp_path / "lm")
    body = orjson.dumps({"prompt": "the cat sat", "max_tokens": 12, "temperature": 0, "stream": True})
    config = service_config(broker.bootstrap_servers, topics, handler="generate", model=model_dir,
                            handler_options={"decoding": "greedy"}, delivery="exactly-once", commit_interval_ms=100,
                            stream_every_tokens=1)
    with Service(config) as service:
        assert service.wait_ready(60)
        produce(broker.bootstrap_servers, topics["requests"], [(None, body, [(protocol.CORRELATION_ID, b"eo")])])
        (final,) = read(broker.bootstrap_servers, topics["replies"], 1, timeout_s=60, settle_s=2,
                        **{"isolation.level": "read_committed"})
    headers = headers_of(final)
    assert (headers[protocol.EVENT], headers[protocol.SEQUENCE]) == (b"final", b"0")
    assert orjson.loads(final.value())["object"] == "chat.completion"
