"""Process-level fault injection for kinference: members, load, commit watch and an audit of every reply.

- ``Member``: one ``kinference serve`` child process (JSON logs on stderr, parsed as they arrive into
  ``assigned``/``revoked``/``lost`` events stamped with the child's own wall clock), stopped by PID.
- ``Group``: the members of one consumer group; ``wait_stable`` waits until the live members own every
  partition exactly once; leaving the ``with`` block SIGKILLs whatever still runs.
- ``Load``: a thread that sends ``{"seq": i}`` requests at a steady rate with ``Client`` and
  keeps every future.
- ``CommitWatch``: a thread that samples the group's committed offsets (with the time they were seen).
- ``audit``: reads the whole request and reply topics and joins them on correlation id, so every
  reply is tied to the request's partition and offset, the process that produced it (``TaggedEcho``
  puts its PID in the result) and when (the reply's CreateTime).

Times that are compared with each other are epoch milliseconds taken on this one machine: log-line
timestamps (``ts`` of kinference's JSON logs), reply CreateTimes (set by the member's producer when it
produced the reply) and the moments this process killed a member or saw a commit.
"""

from __future__ import annotations

import bisect
import itertools
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, TopicPartition

from kinference import protocol
from kinference.loadgen.client import Client
from kinference.loadgen.errors import RequestTimeout
from kinference.loadgen.reply import Reply
from tests.conftest import FETCH_PROPERTIES, TEST_CONSUMER_PROPERTIES
from tests.integration.kafka_io import committed, headers_of

REPO = Path(__file__).resolve().parents[2]
HANDLER = "tests.faults.handlers:TaggedEcho"
_EVENT = re.compile(r"^(assigned|revoked|lost) ")
_PARTITION = re.compile(r"\[(\d+)\]")
_DROPPED = re.compile(r"^revoked .*\((\d+) waiting requests left to the next owner\)")
_TICK_S = 0.05


def now_ms() -> int:
    return int(time.time() * 1000)


# --- members ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """An ``assigned``/``revoked``/``lost`` log line of a member, at the member's wall clock."""

    ms: int
    kind: str
    partitions: frozenset[int]


@dataclass(frozen=True)
class Settings:
    """What every member of a test group runs with (flags of ``kinference serve``)."""

    bootstrap: str
    topics: dict[str, str]
    group_id: str
    partitions: int
    max_in_flight: int = 256
    max_poll_records: int = 64
    commit_interval_ms: int = 200
    session_timeout_ms: int = int(TEST_CONSUMER_PROPERTIES["session.timeout.ms"])
    heartbeat_interval_ms: int = int(TEST_CONSUMER_PROPERTIES["heartbeat.interval.ms"])
    extra: tuple[str, ...] = ()
    broker_kind: str = "tansu"
    assignor: str | None = None
    """The classic protocol's assignor; None: kinference's default (cooperative-sticky)."""
    group_protocol: str = "classic"
    """``consumer``: KIP-848's protocol, where session and heartbeat settings belong to the broker."""

    @property
    def window(self) -> int:
        """The duplicate budget of one SIGKILLed member: what it consumed and did not commit. Work
        not yet acknowledged (whose reply may already be on the broker) is capped by ``max_in_flight``
        plus the one poll that takes it past the mark; work answered since the last commit is about
        ``commit_interval_ms`` x the member's rate (~30 at the rates of these tests), inside this budget."""
        return self.max_in_flight + self.max_poll_records

    def args(self) -> list[str]:
        args = [
            "--bootstrap-servers", self.bootstrap,
            "--request-topics", self.topics["requests"],
            "--reply-topic", self.topics["replies"],
            "--dead-letter-topic", self.topics["dead"],
            "--group-id", self.group_id,
            "--handler", HANDLER,
            "--device", "cpu",
            "--no-metrics",
            "--log-format", "json",
            "--max-in-flight", str(self.max_in_flight),
            "--max-poll-records", str(self.max_poll_records),
            "--commit-interval-ms", str(self.commit_interval_ms),
            # Tests wait up to 30 s for a SIGTERMed member: its own deadline must end well before (a test's
            # extra arguments come last and win).
            "--shutdown-grace-s", "10",
            *[arg for key, value in FETCH_PROPERTIES.items() for arg in ("--kafka-consumer", f"{key}={value}")],
        ]
        if self.group_protocol == "classic":
            args += ["--kafka-consumer", f"session.timeout.ms={self.session_timeout_ms}",
                     "--kafka-consumer", f"heartbeat.interval.ms={self.heartbeat_interval_ms}"]
        else:
            args += ["--kafka-consumer", f"group.protocol={self.group_protocol}"]
        if self.assignor is not None:
            args += ["--kafka-consumer", f"partition.assignment.strategy={self.assignor}"]
        return [*args, *self.extra]


class Member:
    """``kinference serve`` in a child process; its stderr is read line by line on a thread."""

    def __init__(self, name: str, args: list[str], own_group: bool = False) -> None:
        """``own_group``: the member leads a process group of its own (and its children join it), which a test can
        signal as a whole (``os.killpg``), as systemd signals a unit's control group."""
        self.name = name
        self.process = subprocess.Popen([sys.executable, "-m", "kinference", "serve", *args], cwd=REPO,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        process_group=0 if own_group else None)
        self.pid = self.process.pid
        self.started_ms = now_ms()
        self.ended_ms: int | None = None
        """When this process was seen dead (SIGKILL: right after the kill)."""
        self.killed = False
        self.lines: list[str] = []
        self.messages: list[dict] = []
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._pump = threading.Thread(target=self._read_stderr, name=f"stderr-{name}", daemon=True)
        self._pump.start()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._lock:
                self.lines.append(line)
                try:
                    entry = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # librdkafka or Python writing plain text
                self.messages.append(entry)
                if match := _EVENT.match(entry.get("message", "")):
                    self.events.append(Event(_epoch_ms(entry["ts"]), match.group(1),
                                             frozenset(int(p) for p in _PARTITION.findall(entry["message"]))))

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    @property
    def owned(self) -> frozenset[int] | None:
        """The partitions the member holds now; ``None`` before its first assignment. Eager protocols revoke
        everything and assign the new set; incremental ones (cooperative-sticky, KIP-848) assign and revoke
        only what moves, so the events are folded."""
        with self._lock:
            events = list(self.events)
        if not any(event.kind == "assigned" for event in events):
            return None
        held: set[int] = set()
        for event in events:
            if event.kind == "assigned":
                held |= event.partitions
            else:
                held -= event.partitions
        return frozenset(held)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def count(self, kind: str) -> int:
        return sum(event.kind == kind for event in self.events)

    def dropped(self) -> int:
        """Waiting requests this member left to the next owners at its revokes (work a rebalance cost)."""
        return sum(int(match.group(1)) for message in self.messages
                   if (match := _DROPPED.search(message.get("message", ""))))

    def said(self, fragment: str) -> bool:
        return any(fragment in message.get("message", "") for message in self.messages)

    def kill(self) -> None:
        """SIGKILL this member by PID and wait until it is gone."""
        if self.running:
            self.process.kill()
            self.killed = True
        self.process.wait(30)
        self._ended()

    def terminate(self) -> None:
        """SIGTERM this member by PID (a graceful stop); ``wait_exit`` for its exit code."""
        self.process.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float) -> int:
        """The exit code; past ``timeout_s``, an ``AssertionError`` with the member's last log lines."""
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout_s} s after the wait began\n{self.tail()}") from None
        self._ended()
        return code

    def _ended(self) -> None:
        if self.ended_ms is None:
            self.ended_ms = now_ms()
        self._pump.join(5)  # every line the process wrote is read

    def tail(self, lines: int = 30) -> str:
        return f"--- {self.name} (pid {self.pid}) ---\n" + "".join(self.lines[-lines:])


class Group:
    """The members of one consumer group. ``with Group(settings) as group:``; on leaving, every member
    still running is SIGKILLed by PID."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.members: list[Member] = []

    def start(self, name: str | None = None, extra: Iterable[str] = ()) -> Member:
        member = Member(name or f"m{len(self.members)}", [*self.settings.args(), *extra])
        self.members.append(member)
        return member

    @property
    def live(self) -> list[Member]:
        return [member for member in self.members if member.running]

    def stable(self) -> bool:
        """Every live member holds partitions (these tests never run more members than partitions) and together
        they own each partition exactly once."""
        live = self.live
        owned = [member.owned for member in live]
        if not live or any(not partitions for partitions in owned):
            return False
        flat = [p for partitions in owned for p in partitions]  # type: ignore[union-attr]
        return sorted(flat) == list(range(self.settings.partitions))

    def wait_stable(self, timeout_s: float) -> float:
        """Wait until ``stable()``; the seconds it took. Fails with the members' log tails."""
        started = time.monotonic()
        deadline = started + timeout_s
        while not self.stable():
            if time.monotonic() >= deadline:
                raise AssertionError(f"group not stable within {timeout_s} s\n{self.tails()}")
            time.sleep(_TICK_S)
        return time.monotonic() - started

    def stop_all(self, timeout_s: float) -> dict[str, int]:
        """SIGTERM every live member (all at once, then wait each); exit codes by member name."""
        live = self.live
        for member in live:
            member.terminate()
        deadline = time.monotonic() + timeout_s
        return {member.name: member.wait_exit(max(0.1, deadline - time.monotonic())) for member in live}

    def assignments(self) -> int:
        return sum(member.count("assigned") for member in self.members)

    def tails(self) -> str:
        return "\n".join(member.tail() for member in self.members)

    def close(self) -> None:
        for member in self.members:
            member.kill()

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _epoch_ms(ts: str) -> int:
    """kinference's JSON log ``ts`` (UTC, millisecond precision) -> epoch ms."""
    return int(datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp() * 1000 + 0.5)


# --- load ---------------------------------------------------------------------------------------


class Load:
    """Sends ``{"seq": i}`` (key ``str(i)``) at ``rate`` per second from a thread until ``count`` are
    sent or ``stop()``; ``futures[i]`` is request i's future."""

    def __init__(self, client: Client, rate: float, count: int) -> None:
        self.client = client
        self.rate = rate
        self.count = count
        self.futures: list[Future[Reply]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-load", daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def _run(self) -> None:
        started = time.monotonic()
        try:
            for seq in range(self.count):
                due = started + seq / self.rate
                if self._stop.wait(max(0.0, due - time.monotonic())):
                    return
                self.futures.append(self.client.send({"seq": seq}, key=str(seq)))
        except BaseException as exc:  # the test reads it
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the load thread did not finish in time"
        assert not self.errors, self.errors

    @property
    def sent(self) -> int:
        return len(self.futures)

    def wait_answered(self, timeout_s: float) -> dict[int, Reply | BaseException]:
        """Every sent request's outcome by seq: its reply, or the error its future failed with."""
        deadline = time.monotonic() + timeout_s
        outcomes: dict[int, Reply | BaseException] = {}
        for seq, future in enumerate(self.futures):
            try:
                outcomes[seq] = future.result(max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # RequestTimeout, or concurrent.futures.TimeoutError here
                outcomes[seq] = exc
        return outcomes


class AuditedClient(Client):
    """``Client`` that also remembers the offset of every reply record its reader thread got,
    to tell a reply the broker never handed to the client from one the client dropped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: set[int] = set()

    def _on_record(self, record: Any) -> None:  # the client's per-record hook, on its reader thread
        if record.error() is None:
            self.seen.add(record.offset())
        super()._on_record(record)

    def unseen(self, offsets: Iterable[int]) -> list[int]:
        return sorted(set(offsets) - self.seen)


def client_for(settings: Settings) -> AuditedClient:
    """A client on reply partition 0 with a timeout well past any recovery in these tests (a
    SIGKILLed member's partitions wait ~6 s for its session to expire, then ~3 s for the join)."""
    return AuditedClient(settings.bootstrap, settings.topics["requests"], settings.topics["replies"],
                         reply_partition=0, timeout_s=45.0, max_pending=20_000, reply_consumer=FETCH_PROPERTIES)


@dataclass
class RunEnd:
    exit_codes: dict[str, int]
    result: Audit
    skipped: list[int]
    stats: Any


def end_run(settings: Settings, group: Group, load: Load, client: AuditedClient) -> RunEnd:
    """Wait for the load's replies, stop every member, audit both topics and check the client."""
    outcomes = load.wait_answered(60)
    exit_codes = group.stop_all(30)
    result = audit(settings, load.sent)
    return RunEnd(exit_codes, result, check_client(client, result, outcomes, settings.broker_kind), client.stats())


def check_client(client: AuditedClient, result: Audit, outcomes: dict[int, Reply | BaseException],
                 broker_kind: str) -> list[int]:
    """The client resolved each request exactly once, and right: with its own reply when the broker
    handed the client's reader one of the request's reply records, with ``RequestTimeout`` only when
    it handed none; it dropped exactly the extra copies it read (``stats().duplicates``).

    Returns the reply offsets on the topic that the client's reader never got. Tansu can skip record
    batches for a consumer reading at the end of a partition that several producers write at once
    (here: every member's replies go to the one reply partition), so skips are allowed on Tansu only.
    Call once every member has stopped."""
    offsets = {answer.reply_offset for answer in result.answers}
    deadline = time.monotonic() + 5.0
    while client.unseen(offsets) and time.monotonic() < deadline:
        time.sleep(_TICK_S)
    skipped = client.unseen(offsets)
    assert not skipped or broker_kind == "tansu", f"the broker never delivered reply offsets {skipped[:20]}"
    answered = duplicates = 0
    wrong = []
    for cid, sent in result.requests.items():
        copies = sum(answer.reply_offset in client.seen for answer in result.by_request.get(cid, []))
        answered += copies > 0
        duplicates += max(0, copies - 1)
        if sent.seq not in outcomes:
            continue  # sent outside the load (a test's own request)
        outcome = outcomes[sent.seq]
        expected = isinstance(outcome, Reply) and outcome.ok and outcome.result()["value"]["seq"] == sent.seq
        if (copies and not expected) or (not copies and not isinstance(outcome, RequestTimeout)):
            wrong.append((sent, copies, outcome))
    assert not wrong, f"client outcomes (request, reply copies it read, outcome): {wrong[:10]}"
    stats = client.stats()
    expected_stats = (answered, len(result.requests) - answered, duplicates)
    assert (stats.answered, stats.timed_out, stats.duplicates) == expected_stats, (stats, expected_stats)
    assert stats.late == stats.unmatched == stats.failed == stats.pending == 0, stats
    return skipped


# --- commits ------------------------------------------------------------------------------------


class CommitWatch:
    """Samples the group's committed offsets every ``interval_s`` from a thread. Each sample is
    ``(ms, {partition: offset})`` with ``ms`` taken after the broker answered, so a commit the sample
    shows was made at or before ``ms``."""

    def __init__(self, settings: Settings, interval_s: float = 0.2) -> None:
        self._topic = settings.topics["requests"]
        self._partitions = settings.partitions
        self._consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": settings.group_id,
                                   "enable.auto.commit": "false"})  # never subscribes: not a member
        self._interval_s = interval_s
        self.samples: list[tuple[int, dict[int, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commit-watch", daemon=True)

    def __enter__(self) -> CommitWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()

    def _run(self) -> None:
        partitions = [TopicPartition(self._topic, p) for p in range(self._partitions)]
        while not self._stop.wait(self._interval_s):
            try:
                offsets = self._consumer.committed(partitions, timeout=5)
            except KafkaException:
                continue
            self.samples.append((now_ms(), {tp.partition: tp.offset for tp in offsets if tp.offset >= 0}))


# --- audit --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    seq: int
    partition: int
    offset: int


@dataclass(frozen=True)
class Answer:
    """One reply record on the reply topic."""

    correlation_id: str
    seq: int | None
    pid: int | None
    ms: int
    ok: bool
    reply_offset: int = -1


@dataclass
class Audit:
    """Every request on the request topic joined with every reply on the reply topic."""

    requests: dict[str, Sent]
    answers: list[Answer]
    by_request: dict[str, list[Answer]] = field(init=False)

    def __post_init__(self) -> None:
        self.by_request = defaultdict(list)
        for answer in sorted(self.answers, key=lambda a: a.ms):
            self.by_request[answer.correlation_id].append(answer)

    @property
    def ends(self) -> dict[int, int]:
        """End offset per request partition, from the records read (not the broker's watermarks)."""
        ends: dict[int, int] = {}
        for sent in self.requests.values():
            ends[sent.partition] = max(ends.get(sent.partition, 0), sent.offset + 1)
        return ends

    @property
    def lost(self) -> list[str]:
        return [cid for cid in self.requests if cid not in self.by_request]

    @property
    def unknown(self) -> list[Answer]:
        """Replies whose correlation id no request carried."""
        return [a for a in self.answers if a.correlation_id not in self.requests]

    @property
    def mismatched(self) -> list[Answer]:
        """Replies (first or duplicate) whose echoed request is not the one their correlation id names."""
        return [a for a in self.answers if a.correlation_id in self.requests
                and a.seq != self.requests[a.correlation_id].seq]

    @property
    def errors(self) -> list[Answer]:
        return [a for a in self.answers if not a.ok]

    @property
    def duplicates(self) -> int:
        return sum(len(answers) - 1 for answers in self.by_request.values())

    def duplicated_by(self, members: list[Member]) -> Counter:
        """For every extra reply: the member that produced the *earlier* answer (``?`` if unknown)."""
        names = {member.pid: member.name for member in members}
        counts: Counter = Counter()
        for answers in self.by_request.values():
            for earlier in answers[:-1]:
                counts[names.get(earlier.pid, "?")] += 1
        return counts

    def repeated_by_survivor(self, members: list[Member]) -> list[str]:
        """Requests answered more than once where more than one answer came from a member that was
        never SIGKILLed. A clean hand-over (revoke, SIGTERM) must not cause a second answer; only a
        killed member can leave answered-but-uncommitted work behind."""
        killed = {member.pid for member in members if member.killed}
        return [cid for cid, answers in self.by_request.items()
                if sum(a.pid not in killed for a in answers) > 1]

    def same_member_twice(self) -> list[str]:
        """Requests one process answered twice (reprocessing inside one member)."""
        return [cid for cid, answers in self.by_request.items()
                if len({a.pid for a in answers}) < len(answers)]

    def outside_ownership(self, members: list[Member]) -> list[tuple[str, Answer]]:
        """Replies produced by a member while it did not own the request's partition: before its
        ``assigned`` line, or after its ``revoked``/``lost`` line (or its death)."""
        spans = {member.pid: ownership(member) for member in members}
        bad = []
        for cid, answers in self.by_request.items():
            partition = self.requests[cid].partition if cid in self.requests else None
            for answer in answers:
                if answer.pid is None or partition is None:
                    continue
                if not any(start <= answer.ms <= end for start, end in spans.get(answer.pid, {}).get(partition, [])):
                    bad.append((cid, answer))
        return bad

    def answers_of(self, seqs: Iterable[int]) -> list[tuple[str, Answer]]:
        """(correlation id, answer) of every reply on the topic to the requests with these seqs."""
        wanted = set(seqs)
        return [(cid, answer) for cid, sent in self.requests.items() if sent.seq in wanted
                for answer in self.by_request.get(cid, [])]

    def describe(self, bad: list[tuple[str, Answer]], members: list[Member], limit: int = 5) -> str:
        """Failure detail: each reply with its record, producer and that producer's partition spans."""
        names = {member.pid: member for member in members}
        lines = []
        for cid, answer in bad[:limit]:
            sent = self.requests.get(cid)
            member = names.get(answer.pid)
            where = f"p{sent.partition}/o{sent.offset} seq {sent.seq}" if sent else "unknown request"
            spans = ownership(member).get(sent.partition, []) if member and sent else []
            others = [(a.pid, a.ms) for a in self.by_request.get(cid, []) if a is not answer]
            lines.append(f"{where}: answered by {member.name if member else answer.pid} at {answer.ms} "
                         f"(reply offset {answer.reply_offset}); "
                         f"its spans on that partition {spans}; other answers {others}")
        return "\n".join([*lines, member_events(members)])

    def answered_after_commit(self, samples: list[tuple[int, dict[int, int]]]) -> list[tuple[str, Answer]]:
        """Replies produced after the group's committed offset had passed their record. A record's
        first answer is acknowledged before any commit can cover it, so an answer produced later is a
        second one, by a member that started below that commit: the commit landed after the member
        read the committed offsets (an old owner committing after the hand-over)."""
        passed: dict[int, tuple[list[int], list[int]]] = {}
        for partition in self.ends:
            times, highs, high = [], [], -1
            for ms, offsets in samples:
                if offsets.get(partition, -1) > high:
                    high = offsets[partition]
                    times.append(ms)
                    highs.append(high)
            passed[partition] = (times, highs)
        bad = []
        for cid, answers in self.by_request.items():
            sent = self.requests.get(cid)
            if sent is None:
                continue
            times, highs = passed[sent.partition]
            i = bisect.bisect_right(highs, sent.offset)  # first sample whose commit is past the offset
            if i < len(times):
                bad += [(cid, a) for a in answers if a.ms > times[i]]
        return bad

    def summary(self, members: list[Member]) -> dict:
        return {"requests": len(self.requests), "replies": len(self.answers), "lost": len(self.lost),
                "duplicates": self.duplicates, "errors": len(self.errors),
                "duplicated_by": dict(self.duplicated_by(members))}


def ownership(member: Member) -> dict[int, list[tuple[int, int]]]:
    """Partition -> the ``[start, end]`` ms spans during which the member owned it: from each
    ``assigned`` line to the next ``revoked``/``lost`` line (or the member's end)."""
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    open_since: dict[int, int] = {}
    for event in member.events:
        for partition in event.partitions:
            if event.kind == "assigned":
                open_since[partition] = event.ms
            elif partition in open_since:
                spans[partition].append((open_since.pop(partition), event.ms))
    end = member.ended_ms if member.ended_ms is not None else now_ms()
    for partition, start in open_since.items():
        spans[partition].append((start, end))
    return spans


def overlapping_ownership(members: list[Member]) -> list[tuple[int, str, str]]:
    """(partition, member, member) for each pair of members whose spans on a partition overlap."""
    spans = [(start, end, partition, member.name) for member in members
             for partition, member_spans in ownership(member).items() for start, end in member_spans]
    overlaps = []
    by_partition: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for start, end, partition, name in spans:
        by_partition[partition].append((start, end, name))
    for partition, entries in by_partition.items():
        entries.sort()
        for (_s1, e1, n1), (s2, _e2, n2) in itertools.pairwise(entries):
            if n1 != n2 and s2 < e1:
                overlaps.append((partition, n1, n2))
    return overlaps


def check_single_ownership(members: list[Member]) -> None:
    """No partition owned by two members at once; on failure, every member's assignment events and log tail."""
    overlaps = overlapping_ownership(members)
    check(not overlaps, lambda: f"partitions owned by two members at once {overlaps}\n{member_events(members)}\n"
          + "\n".join(member.tail() for member in members))


def member_events(members: list[Member]) -> str:
    """Each member's assigned/revoked/lost events (wall-clock ms), a line per member."""
    return "\n".join(f"{member.name} (pid {member.pid}, ended {member.ended_ms}, killed {member.killed}): "
                     + ", ".join(f"{e.kind}{sorted(e.partitions)}@{e.ms}" for e in member.events)
                     for member in members)


def commit_regressions(samples: list[tuple[int, dict[int, int]]]) -> list[tuple[int, int, int]]:
    """(partition, before, after) wherever the group's committed offset went backwards between two
    samples: a commit from a member that no longer owned the partition overwrote a newer one."""
    regressions, last = [], {}
    for _ms, offsets in samples:
        for partition, offset in offsets.items():
            if offset < last.get(partition, -1):
                regressions.append((partition, last[partition], offset))
            last[partition] = offset
    return regressions


def audit(settings: Settings, expected: int, timeout_s: float = 30.0) -> Audit:
    """Read the whole request topic (``expected`` records) and the whole reply topic. Call it once
    every member has stopped, so both topics are final."""
    records = read_all(settings.bootstrap, settings.topics["requests"], expected, timeout_s)
    requests = {}
    for record in records:
        cid = headers_of(record)[protocol.CORRELATION_ID].decode()
        requests[cid] = Sent(orjson.loads(record.value())["seq"], record.partition(), record.offset())
    replies = read_all(settings.bootstrap, settings.topics["replies"], expected, timeout_s)
    return Audit(requests, [_answer(record) for record in replies])


def read_all(bootstrap: str, topic: str, expected: int, timeout_s: float, quiet_s: float = 3.0) -> list[Message]:
    """Every record of ``topic``, from the beginning of each partition. Reading stops ``1 s`` after
    ``expected`` records came with nothing more, or after ``quiet_s`` with nothing new (fewer than
    expected: some are missing), or at ``timeout_s``."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"audit-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": "false", "fetch.wait.max.ms": "10"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        records: list[Message] = []
        deadline = time.monotonic() + timeout_s
        last_new = time.monotonic()
        while time.monotonic() < deadline:
            batch = [m for m in consumer.consume(500, 0.1) if m.error() is None]
            now = time.monotonic()
            if batch:
                records += batch
                last_new = now
            elif now - last_new >= (1.0 if len(records) >= expected else quiet_s):
                break
        return records
    finally:
        consumer.close()


def _answer(record) -> Answer:
    headers = headers_of(record)
    body = orjson.loads(record.value())
    result = body.get("result") if isinstance(body, dict) else None
    tagged = isinstance(result, dict) and isinstance(result.get("value"), dict)
    return Answer(
        correlation_id=headers[protocol.CORRELATION_ID].decode(),
        seq=result["value"].get("seq") if tagged else None,
        pid=result.get("pid") if tagged else None,
        ms=record.timestamp()[1],
        ok=headers.get(protocol.STATUS) == b"ok",
        reply_offset=record.offset(),
    )


def final_commits(settings: Settings, ends: dict[int, int]) -> dict[int, int]:
    topic = settings.topics["requests"]
    offsets = committed(settings.bootstrap, settings.group_id, [(topic, p) for p in ends])
    return {partition: offset for (_topic, partition), offset in offsets.items()}


def check(condition: bool, message: Callable[[], str]) -> None:
    """``assert`` whose message is built only on failure (member logs can be long)."""
    if not condition:
        raise AssertionError(message())
