"""Generative faults (issue 28): SIGKILL of the member during 50 concurrent streams, and a rebalance from 1 to 2
members mid-stream, with ``kinference serve --handler generate`` on a tiny Llama (tests/models.py).

50 client threads each keep one ``Client.stream`` going (a closed loop: a new stream as soon as one ends) until the
fault is over and the group has served for a while after it. Then every member stops and both topics are read
whole. Checks:

- 0 lost: every request on the request topic has a final on the reply topic, and every client stream ended with a
  ``chat.completion`` (no gap, no timeout);
- each attempt (``kinference-attempt``) is sequences 0, 1, 2... with at most one final, its last record; its final's
  text is what its chunks add up to; an attempt with no final is an abandoned one: its request's partition was
  taken from its member (killed, or revoked), and the request was generated again under a new attempt;
- the client accepted exactly one final per request, the first one on the reply partition, and the text it
  assembled (its deltas since its last restart) is that final's text; it restarted once per attempt it abandoned;
- commits never passed an unfinished request: at every sample of the group's committed offsets, each request below
  them had a final produced at or before that moment; they never went backwards, and end at the end offsets.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from kinference import protocol
from kinference.loadgen.client import Client
from tests.conftest import BROKER_KIND, FETCH_PROPERTIES
from tests.faults.harness import (
    CommitWatch,
    Group,
    Member,
    Settings,
    check,
    commit_regressions,
    final_commits,
    read_all,
)
from tests.integration.kafka_io import headers_of
from tests.models import build_tiny_causal_lm

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.model]

STREAMS = 50
MAX_REQUESTS = 400
"""The loop's cap: the tests stop sending long before on any machine that keeps up."""
AFTER_FAULT = 20
"""Streams the group finishes after it is stable again, before the load stops."""
PROMPT = "a consumer group reads"
STABLE_S = 60.0
"""A member's start (torch, transformers, the model) and join, or a dead member's session, on a loaded machine."""
STREAM_TIMEOUT_S = 150.0


def generate_args(model_dir: Path) -> tuple[str, ...]:
    # Sampling (temperature 1): an attempt generated again has other text, so the client must drop the old one's.
    return ("--handler", "generate", "--model", str(model_dir), "--handler-options", "kv_cache_tokens=4096",
            "--stream-every-tokens", "4")


@dataclass
class Outcome:
    """One client stream: what it read."""

    correlation_id: str
    text: str = ""
    """The deltas since the last restart: what the client holds at the end."""
    restarts: int = 0
    completion: dict[str, Any] | None = None
    error: BaseException | None = None


class Streams:
    """``concurrency`` threads, each running ``Client.stream`` requests one after the other until ``stop()``."""

    def __init__(self, client: Client, concurrency: int) -> None:
        self.client = client
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._tickets = iter(range(MAX_REQUESTS))
        self.mid = 0
        """Streams that have text and no final yet."""
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"stream-{i}", daemon=True)
                         for i in range(concurrency)]

    def start(self) -> Streams:
        for thread in self._threads:
            thread.start()
        return self

    def _ticket(self) -> int | None:
        with self._lock:
            return None if self._stop.is_set() else next(self._tickets, None)

    def _run(self, worker: int) -> None:
        while (ticket := self._ticket()) is not None:
            # Lengths vary, so that the engine's sequences do not start and end in waves: at any moment some are
            # mid-stream.
            body = {"prompt": PROMPT, "max_tokens": 16 + 8 * (ticket % 5), "temperature": 1.0}
            stream = self.client.stream(body, key=f"{worker}-{ticket}", timeout_s=STREAM_TIMEOUT_S)
            outcome = Outcome(stream.correlation_id)
            started = False
            try:
                for delta in stream:
                    if delta.restart:
                        outcome.restarts += 1
                        outcome.text = ""
                    if delta.text and not started:
                        started = True
                        self._count_mid(+1)
                    outcome.text += delta.text
                outcome.completion = stream.completion
            except Exception as exc:  # the test reads it
                outcome.error = exc
            with self._lock:
                self.outcomes.append(outcome)
                self.mid -= started

    def _count_mid(self, change: int) -> None:
        with self._lock:
            self.mid += change

    @property
    def done(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def wait_done(self, count: int, timeout_s: float, group: Group) -> None:
        deadline = time.monotonic() + timeout_s
        while self.done < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.done} streams done, {count} expected\n{group.tails()}")
            time.sleep(0.05)

    def finish(self, timeout_s: float) -> None:
        """No new stream; wait for those running."""
        self._stop.set()
        for thread in self._threads:
            thread.join(max(0.1, timeout_s))
        assert not any(thread.is_alive() for thread in self._threads), "streams still running"


# --- the audit of both topics


@dataclass(frozen=True)
class Record:
    """A reply record of a generation."""

    event: str
    sequence: int
    attempt: str
    ms: int
    offset: int
    ok: bool
    value: dict[str, Any]

    @property
    def text(self) -> str:
        choice = self.value["choices"][0]
        return choice["delta"].get("content", "") if self.event == "delta" else choice["message"]["content"]


@dataclass
class Attempt:
    records: list[Record] = field(default_factory=list)

    @property
    def final(self) -> Record | None:
        return next((record for record in self.records if record.event == "final"), None)


@dataclass
class GenerationAudit:
    requests: dict[str, tuple[int, int]]
    """Correlation id -> (partition, offset) of the request."""
    attempts: dict[str, dict[str, Attempt]]
    """Correlation id -> attempt id -> its records, by reply offset."""
    commits: dict[str, int] = field(default_factory=dict)

    def finals(self, cid: str) -> list[Record]:
        return sorted((a.final for a in self.attempts.get(cid, {}).values() if a.final is not None),
                      key=lambda record: record.offset)

    @property
    def lost(self) -> list[str]:
        return [cid for cid in self.requests if not self.finals(cid)]

    @property
    def abandoned(self) -> list[tuple[str, Attempt]]:
        return [(cid, attempt) for cid, attempts in self.attempts.items() for attempt in attempts.values()
                if attempt.final is None]

    def summary(self) -> dict[str, int]:
        finals = sum(len(self.finals(cid)) for cid in self.requests)
        return {"requests": len(self.requests), "attempts": sum(map(len, self.attempts.values())),
                "abandoned attempts": len(self.abandoned), "finals": finals,
                "requests with 2+ finals": sum(len(self.finals(cid)) > 1 for cid in self.requests),
                "chunks": sum(r.event == "delta" for a in self.attempts.values() for t in a.values()
                              for r in t.records),
                "lost": len(self.lost), **self.commits}

    @property
    def ends(self) -> dict[int, int]:
        ends: dict[int, int] = {}
        for partition, offset in self.requests.values():
            ends[partition] = max(ends.get(partition, 0), offset + 1)
        return ends


def audit_generations(settings: Settings, expected: int) -> GenerationAudit:
    requests = {}
    for message in read_all(settings.bootstrap, settings.topics["requests"], expected, 30):
        requests[headers_of(message)[protocol.CORRELATION_ID].decode()] = (message.partition(), message.offset())
    attempts: dict[str, dict[str, Attempt]] = defaultdict(lambda: defaultdict(Attempt))
    for message in sorted(read_all(settings.bootstrap, settings.topics["replies"], expected, 30),
                          key=lambda m: m.offset()):
        headers = headers_of(message)
        record = Record(headers[protocol.EVENT].decode(), int(headers[protocol.SEQUENCE]),
                        headers[protocol.ATTEMPT].decode(), message.timestamp()[1], message.offset(),
                        headers.get(protocol.STATUS, b"ok") == b"ok", orjson.loads(message.value()))
        attempts[headers[protocol.CORRELATION_ID].decode()][record.attempt].records.append(record)
    return GenerationAudit(requests, attempts)


def check_attempts(result: GenerationAudit) -> None:
    """Each attempt: sequences 0..n-1 once each, at most one final and last, its text its chunks' sum."""
    for cid, attempts in result.attempts.items():
        assert cid in result.requests, f"a reply to no request: {cid}"
        for attempt_id, attempt in attempts.items():
            records = attempt.records
            assert [r.sequence for r in records] == list(range(len(records))), (cid, attempt_id, records)
            assert all(r.event == "delta" for r in records[:-1]), (cid, attempt_id, records)
            final = attempt.final
            if final is not None:
                assert final.ok, final.value
                assert final.value["id"] == f"chatcmpl-{attempt_id}"
                assert final.text == "".join(r.text for r in records[:-1]), (cid, attempt_id)


def check_clients(result: GenerationAudit, outcomes: list[Outcome]) -> None:
    """Every stream ended with the first final on the topic, its text whole, one restart per abandoned attempt."""
    failed = [(o.correlation_id, o.error) for o in outcomes if o.error is not None or o.completion is None]
    assert not failed, failed[:5]
    assert {o.correlation_id for o in outcomes} == set(result.requests)
    for outcome in outcomes:
        accepted = result.finals(outcome.correlation_id)[0]
        assert outcome.completion == accepted.value, (outcome.correlation_id, outcome.completion, accepted)
        assert outcome.text == accepted.text, (outcome.correlation_id, outcome.text, accepted.text)
        before = {a for a, attempt in result.attempts[outcome.correlation_id].items()
                  if attempt.records[0].offset <= accepted.offset}
        assert outcome.restarts == len(before) - 1, (outcome.correlation_id, outcome.restarts, before)


def check_commits(result: GenerationAudit, samples: list[tuple[int, dict[int, int]]]) -> int:
    """No commit ever passed a request whose final was not produced yet; how many samples showed a commit."""
    first_final = {cid: result.finals(cid)[0].ms for cid in result.requests if result.finals(cid)}
    by_partition: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for cid, (partition, offset) in result.requests.items():
        by_partition[partition].append((offset, cid))
    bad, seen = [], 0
    for ms, offsets in samples:
        seen += bool(offsets)
        for partition, committed in offsets.items():
            bad += [(partition, offset, cid, ms) for offset, cid in by_partition[partition]
                    if offset < committed and first_final.get(cid, ms + 1) > ms]
    assert not bad, f"commits past requests not finished then (partition, offset, cid, sample ms): {bad[:10]}"
    assert not commit_regressions(samples)
    return seen


def run_checks(settings: Settings, group: Group, streams: Streams, commits: CommitWatch) -> GenerationAudit:
    """Stop the members, audit both topics, check it all; the audit's summary gets the commits checked."""
    exit_codes = group.stop_all(30)
    result = audit_generations(settings, len(streams.outcomes))
    check(not result.lost, lambda: f"no final for {result.lost[:10]}\n{group.tails()}")
    check_attempts(result)
    check_clients(result, streams.outcomes)
    samples = check_commits(result, commits.samples)
    assert samples > 0
    final = final_commits(settings, result.ends)
    assert final == result.ends
    result.commits = {"commit samples checked": samples, "committed at the end": sum(final.values())}
    assert set(exit_codes.values()) == {0}, (exit_codes, group.tails())
    return result


def client_for(settings: Settings) -> Client:
    return Client(settings.bootstrap, settings.topics["requests"], settings.topics["replies"], reply_partition=0,
                  timeout_s=STREAM_TIMEOUT_S, reply_consumer=FETCH_PROPERTIES)


def wait_mid_stream(streams: Streams, group: Group, member: Member) -> None:
    """Some streams finished, and the member is generating others that have sent text already."""
    streams.wait_done(10, STABLE_S, group)
    deadline = time.monotonic() + STABLE_S
    while streams.mid < 10:
        assert time.monotonic() < deadline, f"no streams mid-way\n{member.tail()}"
        time.sleep(0.01)
    assert member.running, member.tail()


# --- the tests


@pytest.mark.timeout(300)
def test_sigkill_during_50_streams_loses_nothing_and_the_restarted_member_finishes_them(fault_settings, tmp_path):
    model = build_tiny_causal_lm(tmp_path / "lm")
    settings = fault_settings(extra=generate_args(model))
    with Group(settings) as group, CommitWatch(settings) as commits, client_for(settings) as client:
        victim = group.start("a")
        group.wait_stable(STABLE_S)
        streams = Streams(client, STREAMS).start()
        wait_mid_stream(streams, group, victim)
        done_at_kill = streams.done
        victim.kill()
        group.start("a1")
        recovery = group.wait_stable(STABLE_S)
        streams.wait_done(streams.done + AFTER_FAULT, STREAM_TIMEOUT_S, group)
        streams.finish(STREAM_TIMEOUT_S)
        result = run_checks(settings, group, streams, commits)
    print(f"\nsigkill: {result.summary()}, done at the kill {done_at_kill}, client restarts "
          f"{sum(o.restarts for o in streams.outcomes)}, recovery {recovery:.1f} s")
    # The kill hit generations mid-stream: their attempts were abandoned, and generated again by the new member.
    assert result.abandoned and any(o.restarts for o in streams.outcomes)
    # An abandoned attempt, and a second final, come only from the killed member: all its records before the kill.
    assert all(attempt.records[-1].ms <= victim.ended_ms for _cid, attempt in result.abandoned)
    for cid in result.requests:
        finals = result.finals(cid)
        assert all(final.ms <= victim.ended_ms for final in finals[:-1]), (cid, finals)


@pytest.mark.timeout(300)
@pytest.mark.skipif(BROKER_KIND == "tansu", reason="Apache Kafka only (make test-kafka): on Tansu a cooperative "
                    "rebalance takes two rounds of half a session each, and the test 4 minutes (it passed there)")
def test_rebalance_1_to_2_mid_stream_generates_revoked_requests_again_under_new_attempts(fault_settings, tmp_path):
    model = build_tiny_causal_lm(tmp_path / "lm")
    settings = fault_settings(extra=generate_args(model))
    with Group(settings) as group, CommitWatch(settings) as commits, client_for(settings) as client:
        first = group.start("a")
        group.wait_stable(STABLE_S)
        streams = Streams(client, STREAMS).start()
        wait_mid_stream(streams, group, first)
        group.start("b")
        joined = group.wait_stable(STABLE_S)
        streams.wait_done(streams.done + AFTER_FAULT, STREAM_TIMEOUT_S, group)
        streams.finish(STREAM_TIMEOUT_S)
        revoked = {p: event.ms for event in first.events if event.kind in ("revoked", "lost") for p in event.partitions}
        assert first.count("revoked") >= 1 and not first.count("lost")
        result = run_checks(settings, group, streams, commits)  # its SIGTERMs revoke the rest
    print(f"\nrebalance: {result.summary()}, client restarts {sum(o.restarts for o in streams.outcomes)}, "
          f"revoked from a {sorted(revoked)}, join {joined:.1f} s")
    assert result.abandoned and any(o.restarts for o in streams.outcomes)
    # Only the revoked partitions' generations were abandoned.
    assert all(result.requests[cid][0] in revoked for cid, _attempt in result.abandoned)
    # A request is answered twice only when the old owner answered it before the hand-over while an earlier request
    # of its partition was still generating (aborted then): the commit could not pass that one, so the next owner
    # served both again. The client took the first final and dropped the second attempt (check_clients).
    twice = [cid for cid in result.requests if len(result.finals(cid)) > 1]
    for cid in twice:
        partition, offset = result.requests[cid]
        assert partition in revoked and result.finals(cid)[0].ms <= revoked[partition], (cid, result.finals(cid))
        assert any(other_partition == partition and other_offset < offset
                   and result.finals(other)[0].ms > revoked[partition]
                   for other, (other_partition, other_offset) in result.requests.items()), cid
