"""Fuzzing through the real broker: a few thousand generated records (values and headers) to a running
service (echo handler). Each gets exactly one reply, with the outcome the protocol promises for it, and a
dead letter exactly when it is unreadable; the service stays healthy.

The records come from a seeded ``random.Random`` (``KINFERENCE_FUZZ_SEED`` to vary it), so a failure can be
replayed. The expected outcome of each record is derived from its content with the service's own
``RequestDecoder`` (run here on the record as produced), its deadline and whether orjson can encode its
echo. What this adds to the unit-level fuzz (tests/unit/consumer/path/test_request_fuzz.py) is everything between: the
broker round trip of odd values and headers, the poll loop, batching, the stages and the publisher.

Excluded on purpose (known to kill the publisher thread, see tests/faults/test_poison.py): reply-to
topics other than the reply topic, reply partitions other than 0, and records near the producer's
``message.max.bytes``.
"""

from __future__ import annotations

import os
import random
import struct
import time
from collections import Counter

import orjson
import pytest

from kinference import protocol
from kinference.consumer.path import request as requests
from kinference.consumer.service import Service
from kinference.protocol import ErrorCode
from tests.fakes import FakeRecord
from tests.integration.kafka_io import headers_of, produce, read, service_config

pytestmark = [pytest.mark.integration, pytest.mark.faults]

SEED = int(os.environ.get("KINFERENCE_FUZZ_SEED", "20240611"))
COUNT = 3000
MAX_REQUEST_BYTES = 2048
MAX_HEADER_BYTES = 512
NASTY_VALUES = [
    None, b"", b" ", b"\x00", b"NaN", b"Infinity", b"-0", b"1e400", b"1e-400", b"18446744073709551616",
    b'"\\ud800"', b'"\\udc00\\ud800"', b'"\\u0000"', b"\xef\xbb\xbf{}", b"{}", b"[]", b'{"a":1,"a":2}',
    b"[" * 253 + b"]" * 253, b"[" * 254 + b"]" * 254, b"[" * 300 + b"]" * 300, b"[" * 1025 + b"]" * 1025,
    b'"' + "é".encode() * 1023 + b'"', b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"true false",
]


class Generator:
    """Random request records: valid JSON, mutated JSON, raw bytes and known nasty values, with headers
    that are valid, garbage or missing."""

    def __init__(self, seed: int, reply_topic: str) -> None:
        self.rng = random.Random(seed)
        self.reply_topic = reply_topic.encode()

    def record(self, i: int) -> tuple[bytes, bytes | None, list]:
        return f"f{i:05d}".encode(), self.value(), self.headers()

    def value(self) -> bytes | None:
        rng = self.rng
        kind = rng.random()
        if kind < 0.35:
            return orjson.dumps(self.json(3))
        if kind < 0.60:
            return self.mutate(orjson.dumps(self.json(3)))
        if kind < 0.75:
            return rng.randbytes(rng.randint(0, 64))
        if kind < 0.85:
            return rng.choice(NASTY_VALUES)
        if kind < 0.93:
            return "".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(1, 30))).encode("utf-8", "replace")
        size = rng.choice([MAX_REQUEST_BYTES - 1, MAX_REQUEST_BYTES, MAX_REQUEST_BYTES + 1, 3 * MAX_REQUEST_BYTES])
        return b'"' + b"x" * (size - 2) + b'"'  # a JSON string of `size` bytes, around the limit

    def json(self, depth: int) -> object:
        rng = self.rng
        choice = rng.randint(0, 9 if depth > 0 else 5)
        if choice == 0:
            return None
        if choice == 1:
            return rng.choice([True, False])
        if choice == 2:
            return rng.choice([0, -1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randint(-1000, 1000)])
        if choice == 3:
            return rng.choice([0.0, -0.0, 1.5e308, 5e-324, rng.uniform(-1e6, 1e6)])
        if choice <= 5:
            return self.text()
        if choice <= 7:
            return [self.json(depth - 1) for _ in range(rng.randint(0, 4))]
        return {self.text(): self.json(depth - 1) for _ in range(rng.randint(0, 4))}

    def text(self) -> str:
        """ASCII and BMP characters (lone surrogates come out as "?")."""
        rng = self.rng
        chars = (chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0x80, 0xFFFF)]))
                 for _ in range(rng.randint(0, 12)))
        return "".join(chars).encode("utf-8", "replace").decode()

    def mutate(self, data: bytes) -> bytes:
        rng, buf = self.rng, bytearray(data)
        for _ in range(rng.randint(1, 3)):
            at = rng.randint(0, len(buf))
            action = rng.choice(["flip", "insert", "delete", "truncate"])
            if action == "truncate":
                del buf[at:]
            elif action == "insert" or at == len(buf):
                buf[at:at] = rng.choice([b"{", b"}", b"[", b"]", b'"', b",", b":", b"\\", b"\xff", b"\x00", b"e9"])
            elif action == "delete":
                del buf[at]
            else:
                buf[at] ^= 1 << rng.randint(0, 7)
        return bytes(buf)

    def headers(self) -> list:
        rng = self.rng
        headers = []
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 5])):
            name = rng.choice([protocol.CORRELATION_ID, protocol.REPLY_TO, protocol.DEADLINE_MS,
                               protocol.SPRING_CORRELATION_ID, protocol.SPRING_REPLY_TOPIC,
                               protocol.SPRING_REPLY_PARTITION, "x-trace", "", "ü-name", "kinference-unknown"])
            headers.append((name, self.header_value(name)))
        if rng.random() < 0.03:
            headers.append(("x-pad", b"p" * rng.choice([MAX_HEADER_BYTES // 2, MAX_HEADER_BYTES])))
        return headers

    def header_value(self, name: str) -> bytes | None:
        rng = self.rng
        if rng.random() < 0.1:
            return None
        if name in (protocol.REPLY_TO, protocol.SPRING_REPLY_TOPIC):  # the reply topic, or an illegal name
            return rng.choice([self.reply_topic, b"", b"..", b".", b"bad topic", b"a" * 250, b"\xff", b"t/x",
                               b"\x00" + rng.randbytes(rng.randint(0, 8))])
        if name == protocol.SPRING_REPLY_PARTITION:  # only partition 0 exists: others would be refused
            return rng.choice([struct.pack(">i", 0), struct.pack(">i", -rng.randint(1, 2**31)),
                               rng.randbytes(rng.choice([0, 1, 2, 3, 5, 8]))])
        if rng.random() < 0.2:
            return rng.randbytes(rng.randint(0, 12))
        if name == protocol.DEADLINE_MS:
            now = int(time.time() * 1000)
            return rng.choice([str(now + 600_000), str(now - 1000), "0", "-5", " 12 ", "+1", "1_0", "9" * 40,
                               "soon", "1e12", "١٢"]).encode()
        if name == protocol.CORRELATION_ID:
            return rng.choice([f"c{rng.randint(0, 10**6)}", "", "x" * 256, "x" * 257, "ζ" * 256]).encode()
        return rng.randbytes(rng.randint(0, 20))


def expected_outcome(decoder: requests.RequestDecoder, record: tuple, sent_ms: float) -> tuple[str, bool]:
    """(code or "ok", dead letter?) that the protocol promises for this record."""
    key, value, headers = record
    request = decoder.decode(FakeRecord(value, headers=headers or None, key=key))
    if request.error is not None:
        return str(request.error.code), True
    if request.expired(sent_ms):
        return str(ErrorCode.DEADLINE_EXCEEDED), False
    try:
        protocol.encode_result(request.payload)
    except TypeError:  # the echo of a document nested deeper than orjson encodes
        return str(ErrorCode.HANDLER_ERROR), False
    return "ok", False


def collect(service: Service, bootstrap: str, topic: str, count: int, timeout_s: float = 60.0) -> list:
    """Read ``topic`` until ``count`` records came (then 1 s more), or until a service thread died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = read(bootstrap, topic, count, timeout_s=min(3.0, deadline - time.monotonic()))
        if len(records) >= count:
            return read(bootstrap, topic, count, settle_s=1.0)  # duplicates would show up too
        if not service.healthy:
            break
    return records


def test_fuzzed_records_each_get_one_reply_with_the_promised_outcome(broker):
    topics = broker.topics(requests=2, replies=1, dead=1)
    generator = Generator(SEED, topics["replies"])
    records = [generator.record(i) for i in range(COUNT)]
    config = service_config(broker.bootstrap_servers, topics, metrics=False, max_request_bytes=MAX_REQUEST_BYTES,
                            max_header_bytes=MAX_HEADER_BYTES, max_batch_size=64, micro_batch_size=16,
                            shutdown_grace_s=5.0, rebalance_drain_ms=500)
    decoder = requests.RequestDecoder(topics["replies"], MAX_REQUEST_BYTES, "json", MAX_HEADER_BYTES)
    started = time.monotonic()
    with Service(config) as service:
        assert service.wait_ready(30)
        sent_ms = time.time() * 1000
        produce(broker.bootstrap_servers, topics["requests"], records)
        replies = collect(service, broker.bootstrap_servers, topics["replies"], COUNT)
        expected = {record[0]: expected_outcome(decoder, record, sent_ms) for record in records}
        dead_count = sum(dead for _code, dead in expected.values())
        dead = read(broker.bootstrap_servers, topics["dead"], dead_count, timeout_s=30 if service.healthy else 1,
                    settle_s=0.5)
        healthy = service.healthy
    runtime_s = time.monotonic() - started

    codes = Counter(code for code, _dead in expected.values())
    summary = f"seed {SEED}: {COUNT} records, {len(replies)} replies, {len(dead)} dead letters, {dict(codes)}, " \
              f"{runtime_s:.1f} s"
    print(summary)
    assert healthy, summary
    counts = Counter(reply.key() for reply in replies)
    assert set(counts) == set(expected) and set(counts.values()) == {1}, f"exactly one reply each; {summary}"
    values = {key: value for key, value, _headers in records}
    wrong = []
    for reply in replies:
        headers, body = headers_of(reply), orjson.loads(reply.value())
        code = "ok" if headers[protocol.STATUS] == b"ok" else body["error"]["code"]
        if code != expected[reply.key()][0]:
            wrong.append((reply.key(), values[reply.key()], code, expected[reply.key()][0]))
        elif code == "ok" and reply.value() != protocol.encode_result(orjson.loads(values[reply.key()])):
            wrong.append((reply.key(), values[reply.key()], "result differs from the request", reply.value()))
        elif code != "ok":
            assert headers[protocol.ERROR_CODE] == code.encode()
    assert not wrong, f"{len(wrong)} replies differ from the protocol, first: {wrong[:3]}"
    letters = Counter(letter.key() for letter in dead)
    assert letters == Counter(key for key, (_code, is_dead) in expected.items() if is_dead)
    for letter in dead:
        assert headers_of(letter)[protocol.ERROR_CODE].decode() == expected[letter.key()][0]
    assert runtime_s < 60, summary
