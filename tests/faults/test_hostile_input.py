"""Issue 29's target, as one run: every hostile record of the review, each with a valid request right behind it in
the same partition, through ``kinference serve`` (a child process, so that an exit shows). The service never exits,
every valid request is answered once and every hostile record gets its one reply (and a dead letter where it cannot
be read as a request), the commit reaches the end offset, RSS stays under the byte budget above the process's own,
and the valid requests behind hostile records wait less than a second longer (p50) than the same requests without
them, measured side by side on the same process.

Each run goes through both paths (issue 36, item 4): the service in one process, and ``--device-process on
--workers 2`` (a supervisor, two workers and the device process that runs the model for both: the default where
CUDA is), one service per run. The Schema Registry's hostile records (issue 36) have a run of their own, through
a registry the service's processes reach (``tests.schemas.LocalRegistry``, each answer 20 ms late): 600 records
naming an unknown schema id, then an Avro value that would hold 192x its bytes decoded or Protobuf values whose
prefix lists 100,000 message indexes.

On Apache Kafka a transactional upstream writes a committed and an aborted transaction into the run too, and the
commit is checked against the log's end offset. Tansu shows aborted records to read_committed readers, so there the
run has no transactions (tests/integration/test_offset_gaps.py says more), and its end offset, wrong after a batch
of several records, is not read: every record's one answer is counted instead."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator

import orjson
import psutil
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from kinference import protocol
from tests.faults.harness import Group, Member, Settings, check
from tests.faults.test_device_process import supervised
from tests.integration.kafka_io import headers_of, produce, read
from tests.integration.test_offset_gaps import end_offset, produce_in_transaction, wait_committed
from tests.schemas import LocalRegistry, Producer

pytestmark = [pytest.mark.integration, pytest.mark.faults]

BUDGET = 48 * 2**20
"""--max-in-flight-bytes: small, so that the wide values below (each charged ~20-36 MB) fill it."""
PREFETCH = 16 * 2**20
"""What librdkafka may hold fetched beyond the budget (``queued.max.messages.kbytes``, docs/guarantees.md)."""
VALUE_BYTES = 959_000
"""Just under --max-request-bytes (960,000)."""
PACE_S = 0.4
PATHS = ["in-process", "device-process"]
WORKERS = {"in-process": 1, "device-process": 2}
"""The processes that poll, each with its own byte budget."""


@contextlib.contextmanager
def served(settings: Settings, path: str) -> Iterator[Member]:
    """``kinference serve`` with ``settings``, its partitions assigned: in one process, or ``--device-process on
    --workers 2`` (serving ``DeviceEcho``, run by the device process). The member is the process started (the
    supervisor of the second)."""
    if path == "in-process":
        with Group(settings) as group:
            member = group.start()
            group.wait_stable(60)
            yield member
    else:
        with supervised(settings, "tests.faults.handlers:DeviceEcho") as (supervisor, _port):
            yield supervisor


def hostile_records(missing_topic: str) -> list[tuple[str, bytes | None, bytes, list]]:
    """``(name, key, value, headers)``: the review's records, each answered with an error or (the wide values) a
    result."""
    return [
        ("huge-key", b"k" * 1_000_000, b'{"n": 1}', []),
        ("wide-json", None, b"[" + b",".join([b"[]"] * (VALUE_BYTES // 3)) + b"]", []),
        ("short-strings", None, b"[" + b",".join([b'"ab"'] * (VALUE_BYTES // 5)) + b"]", []),
        ("deep-json", None, b"[" * 400 + b"]" * 400, []),
        ("missing-reply-topic", None, b'{"n": 2}', [(protocol.REPLY_TO, missing_topic.encode())]),
        ("internal-reply-topic", None, b'{"n": 3}', [(protocol.REPLY_TO, b"__consumer_offsets")]),
        ("huge-headers", None, b'{"n": 4}', [("x-padding", b"p" * 20_000)]),
    ]


EXPECTED_CODES = {"huge-key": "payload_too_large", "wide-json": None, "short-strings": None,
                  "deep-json": "bad_request", "missing-reply-topic": "reply_topic_not_found",
                  "internal-reply-topic": "reply_topic_not_allowed", "huge-headers": "payload_too_large"}

DEAD_LETTERS = ["huge-key", "deep-json", "huge-headers"]
"""The records that cannot be read as requests; a refused reply topic is answered, and not a dead letter."""


def record(name: str, key: bytes | None = None, value: bytes | None = None, headers: list | None = None) -> tuple:
    """A request as ``produce`` takes it, with its name as correlation id (a valid one: ``{"name": ...}``)."""
    value = orjson.dumps({"name": name}) if value is None else value
    return key, value, [(protocol.CORRELATION_ID, name.encode()), *(headers or [])]


class PeakRss(threading.Thread):
    """The highest RSS of a process and its children together, sampled every 20 ms until ``stop()``."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="peak-rss", daemon=True)
        self.process = psutil.Process(pid)
        self.peak = self.rss()
        self._done = threading.Event()

    def rss(self) -> int:
        total = self.process.memory_info().rss
        for child in self.process.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += child.memory_info().rss
        return total

    def run(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, self.rss())

    def stop(self) -> int:
        self._done.set()
        self.join(5)
        return self.peak


def latencies_ms(replies: dict[str, object], sent: dict[str, int], names: list[str]) -> list[int]:
    """Each named request's reply CreateTime minus its own (both stamped by producers on this machine)."""
    return [replies[name].timestamp()[1] - sent[name] for name in names]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["in-process", "device-process"])
def test_a_hostile_run_never_stops_the_service_and_the_valid_requests_behind_it_are_answered_on_time(
        fault_settings, broker, path):
    settings = fault_settings(partitions=1, extra=(
        "--max-in-flight-bytes", str(BUDGET), "--reply-topics-allowed", "*",
        "--kafka-producer", "message.max.bytes=2000000"))
    bootstrap, topic = settings.bootstrap, settings.topics["requests"]
    big = {"message.max.bytes": 2_000_000}
    hostile = hostile_records(f"missing-{settings.group_id}")
    transactions = broker.kind == "kafka"
    with served(settings, path) as member:
        # Baseline: valid requests alone, paced as in the hostile run.
        baseline = [f"alone-{i}" for i in range(len(hostile))]
        for name in ["warm", *baseline]:
            produce(bootstrap, topic, [record(name)])
            time.sleep(PACE_S)
        read(bootstrap, settings.topics["replies"], len(baseline) + 1, timeout_s=30)
        peak = PeakRss(member.pid)
        idle_rss = peak.peak
        peak.start()
        # The hostile run: each hostile record, then a valid request right behind it.
        behind = []
        for name, key, value, headers in hostile:
            produce(bootstrap, topic, [record(name, key, value, headers), record(f"behind-{name}")], **big)
            behind.append(f"behind-{name}")
            time.sleep(PACE_S)
        if transactions:
            produce_in_transaction(bootstrap, topic, [record(f"committed-{i}") for i in range(5)], commit=True)
            produce_in_transaction(bootstrap, topic, [record(f"aborted-{i}") for i in range(5)], commit=False)
            produce(bootstrap, topic, [record("after-transactions")])
        valid = ["warm", *baseline, *behind, *([f"committed-{i}" for i in range(5)] + ["after-transactions"]
                                               if transactions else [])]
        answered = valid + [name for name, *_ in hostile]
        replies = read(bootstrap, settings.topics["replies"], len(answered), timeout_s=60, settle_s=2.0)
        if transactions:
            end = end_offset(bootstrap, topic, at_least=len(answered) + 5 + 2)  # the aborted five, two markers
            position = wait_committed(bootstrap, settings.group_id, topic, end)
        dead = read(bootstrap, settings.topics["dead"], len(DEAD_LETTERS), timeout_s=30, settle_s=1.0)
        peak_rss = peak.stop()
        alive = member.running
        requests = {headers_of(m)[protocol.CORRELATION_ID].decode(): m.timestamp()[1]
                    for m in read(bootstrap, topic, len(answered), timeout_s=10)}
    by_name = Counter(headers_of(m).get(protocol.CORRELATION_ID, b"?").decode() for m in replies)
    last = {headers_of(m).get(protocol.CORRELATION_ID, b"?").decode(): m for m in replies}
    codes = {name: (headers_of(last[name]).get(protocol.ERROR_CODE) or b"").decode() or None
             for name, *_ in hostile if name in last}

    check(alive, lambda: f"the service exited\n{member.tail()}")
    check(by_name == Counter(answered), lambda: f"answers: {sorted((by_name - Counter(answered)).items())} extra, "
                                                f"{sorted((Counter(answered) - by_name).items())} missing; codes "
                                                f"{codes}\n{member.tail()}")
    alone, after = latencies_ms(last, requests, baseline), latencies_ms(last, requests, behind)
    print(f"{path}: p50 {statistics.median(alone)} ms alone, {statistics.median(after)} ms behind a hostile record "
          f"(max {max(after)} ms); RSS {idle_rss / 2**20:.0f} MiB idle, peak {peak_rss / 2**20:.0f} MiB")
    assert codes == EXPECTED_CODES
    assert Counter(headers_of(m).get(protocol.CORRELATION_ID, b"?").decode() for m in dead) == Counter(DEAD_LETTERS)
    if transactions:
        assert position == end, "the commit reaches the end of the log, across the markers and aborted records"
    assert peak_rss < idle_rss + WORKERS[path] * (BUDGET + PREFETCH), f"peak RSS {peak_rss / 2**20:.0f} MiB"
    assert statistics.median(after) < statistics.median(alone) + 1000, (alone, after)


UNKNOWN_IDS = 600
INDEXED = 60
REGISTRY_DELAY_S = 0.02


def schema_registry_hostile(value_format: str, client: SchemaRegistryClient, topic: str) -> list[tuple[str, bytes]]:
    """``(name, value)``: 600 records naming schema id 999, which the registry does not know (a value of a few bytes:
    confluent-kafka refuses one of five or fewer before it looks its id up), then the format's own: an Avro
    ``array<record{boolean}>`` of 300 KB (192x its bytes decoded: 58 MB, past ``BUDGET``; the review's was 900 KB,
    whose bytes alone take Apache Kafka ~0.5 s more to carry, in and as a dead letter), or 60 Protobuf values whose
    prefix lists 100,000 message indexes."""
    unknown = b"\x00" + (999).to_bytes(4, "big") + (b"\x00\x0a\x02hi" if value_format == "protobuf" else b"\x04hi")
    records = [(f"unknown-{i}", unknown) for i in range(UNKNOWN_IDS)]
    context = SerializationContext(topic, MessageField.VALUE)
    if value_format == "avro":
        flag = {"type": "record", "name": "Flag", "fields": [{"name": "b", "type": "boolean"}]}
        flags = {"type": "record", "name": "Flags", "namespace": "shop",
                 "fields": [{"name": "a", "type": {"type": "array", "items": flag}}]}
        write = AvroSerializer(client, orjson.dumps(flags).decode())
        return [*records, ("wide-avro", write({"a": [{"b": True}] * 300_000}, context))]
    prefix = Producer("protobuf", client).request(topic, "x")[:5]
    indexed = prefix + b"\xc0\x9a\x0c" + b"\x00" * 100_000 + b"\x0a\x02hi"  # zigzag 100,000, then 100,000 zeros
    return [*records, *((f"indexed-{i}", indexed) for i in range(INDEXED))]


SCHEMA_CODES = {"unknown": "bad_request", "wide-avro": "payload_too_large", "indexed": "bad_request"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("value_format", ["avro", "protobuf"])
@pytest.mark.parametrize("path", PATHS)
def test_hostile_schema_registry_records_are_refused_and_the_requests_behind_them_answered_within_a_second(
        fault_settings, path, value_format):
    """Issue 36: 600 records naming an unknown schema id made a registry call each on the poll thread (p99 of the
    requests behind them 0.01 s -> 38.1 s, a 20 ms registry); a 900 KB Avro value held 173 MB decoded and was
    charged 36 MB; 60 Protobuf values of 100,000 message indexes cost ~50 ms each (a neighbour waited 3.0 s).
    Now: the unknown id is asked about once (per process that polls), each record refused with its reason, the
    Avro value refused before it is decoded (it could never fit in the byte budget), and the valid requests behind
    them answered within a second of the same requests alone."""
    with LocalRegistry(delay_s=REGISTRY_DELAY_S) as registry:
        settings = fault_settings(partitions=1, extra=(
            "--value-format", value_format, "--schema-registry-url", registry.url,
            "--max-in-flight-bytes", str(BUDGET), "--kafka-producer", "message.max.bytes=2000000"))
        bootstrap, topic = settings.bootstrap, settings.topics["requests"]
        client = SchemaRegistryClient({"url": registry.url})
        producer = Producer(value_format, client)
        hostile = schema_registry_hostile(value_format, client, topic)

        def valid(name: str) -> tuple:
            return record(name, value=producer.request(topic, name))

        with served(settings, path) as member:
            baseline = [f"alone-{i}" for i in range(5)]
            for name in ["warm", *baseline]:
                produce(bootstrap, topic, [valid(name)])
                time.sleep(PACE_S)
            read(bootstrap, settings.topics["replies"], len(baseline) + 1, timeout_s=30)
            peak = PeakRss(member.pid)
            idle_rss = peak.peak
            peak.start()
            behind = [f"behind-{i}" for i in range(5)]
            produce(bootstrap, topic, [record(name, value=value) for name, value in hostile] + [valid(behind[0])],
                    **{"message.max.bytes": 2_000_000})
            for name in behind[1:]:
                time.sleep(PACE_S)
                produce(bootstrap, topic, [valid(name)])
            answered = ["warm", *baseline, *behind, *(name for name, _ in hostile)]
            replies = read(bootstrap, settings.topics["replies"], len(answered), timeout_s=90, settle_s=1.0)
            peak_rss = peak.stop()
            alive = member.running
            sent = {headers_of(m)[protocol.CORRELATION_ID].decode(): m.timestamp()[1]
                    for m in read(bootstrap, topic, len(answered), timeout_s=10)}
        lookups = registry.asked["/schemas/ids/999"]
    last = {headers_of(m).get(protocol.CORRELATION_ID, b"?").decode(): m for m in replies}
    by_name = Counter(headers_of(m).get(protocol.CORRELATION_ID, b"?").decode() for m in replies)
    codes = Counter((name.rsplit("-", 1)[0] if name[-1].isdigit() else name,
                     (headers_of(last[name]).get(protocol.ERROR_CODE) or b"").decode())
                    for name, _ in hostile if name in last)

    check(alive, lambda: f"the service exited\n{member.tail()}")
    check(by_name == Counter(answered), lambda: f"answers: {sorted((by_name - Counter(answered)).items())} extra, "
                                                f"{sorted((Counter(answered) - by_name).items())[:5]} missing; "
                                                f"codes {codes}\n{member.tail()}")
    alone, after = latencies_ms(last, sent, baseline), latencies_ms(last, sent, behind)
    print(f"{path} {value_format}: p50 {statistics.median(alone)} ms alone, behind {after} ms; {lookups} lookups "
          f"of the unknown id; RSS {idle_rss / 2**20:.0f} MiB idle, peak {peak_rss / 2**20:.0f} MiB")
    assert all(code == SCHEMA_CODES[kind] for kind, code in codes), codes
    assert not [name for name in ["warm", *baseline, *behind] if protocol.ERROR_CODE in headers_of(last[name])]
    assert 1 <= lookups <= WORKERS[path], f"{lookups} lookups of the unknown schema id"
    # The first request behind the 600 waits for their 1,200 answers (reply and dead letter each) to be produced:
    # 0.2-0.3 s on Tansu, ~0.9 s on Apache Kafka, 1.02 s there once under CI's four test processes. Before the
    # fix it waited 14-16 s (a registry call per record); 2 s keeps that apart from CI's noise.
    assert max(after) < statistics.median(alone) + 2000, (alone, after)
    assert peak_rss < idle_rss + WORKERS[path] * (BUDGET + PREFETCH), f"peak RSS {peak_rss / 2**20:.0f} MiB"
