"""The client's pending table: bounded, deadlines, late / duplicate / unmatched replies, no leaks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from kinference.loadgen.errors import ClientClosed, TooManyPending
from kinference.loadgen.pending import PendingTable, settle


def far() -> float:
    return time.monotonic() + 60


def test_reply_completes_its_own_entry_only_once():
    table = PendingTable(max_pending=10, recent_capacity=100)
    a = table.add("a", far())
    table.add("b", far())
    assert table.take("a") is a
    assert table.take("a") is None, "a second reply for an answered request is a duplicate"
    assert table.take("nobody") is None, "a reply this client never asked for"
    stats = table.stats()
    assert (stats.sent, stats.answered, stats.duplicates, stats.unmatched, stats.pending) == (2, 1, 1, 1, 1)


def test_expired_entries_are_removed_and_a_late_reply_is_counted_not_delivered():
    table = PendingTable(max_pending=10, recent_capacity=100)
    now = time.monotonic()
    table.add("soon", now + 0.01)
    table.add("later", now + 60)
    assert table.next_deadline() == pytest.approx(now + 0.01)
    assert [e.correlation_id for e in table.expire(now + 0.02)] == ["soon"]
    assert table.take("soon") is None
    assert table.take("soon") is None, "a second late copy counts as a duplicate"
    stats = table.stats()
    assert (stats.timed_out, stats.late, stats.duplicates, stats.pending) == (1, 1, 1, 1)


def test_full_table_raises_without_block_and_after_deadline_with_block():
    table = PendingTable(max_pending=2, recent_capacity=10)
    table.add("a", far())
    table.add("b", far())
    with pytest.raises(TooManyPending):
        table.add("c", far(), block=False)
    started = time.monotonic()
    with pytest.raises(TooManyPending):
        table.add("c", time.monotonic() + 0.1)
    assert 0.09 <= time.monotonic() - started < 1.0


def test_blocked_add_proceeds_when_a_reply_frees_room():
    table = PendingTable(max_pending=1, recent_capacity=10)
    table.add("a", far())
    threading.Timer(0.05, table.take, args=("a",)).start()
    assert table.add("b", time.monotonic() + 5).correlation_id == "b"


def test_close_returns_pending_entries_and_wakes_and_refuses_adders():
    table = PendingTable(max_pending=1, recent_capacity=10)
    table.add("a", far())
    errors = []

    def blocked_add():
        try:
            table.add("b", time.monotonic() + 5)
        except ClientClosed as exc:
            errors.append(exc)

    adder = threading.Thread(target=blocked_add)
    adder.start()
    time.sleep(0.05)
    assert [e.correlation_id for e in table.close()] == ["a"]
    adder.join(2)
    assert len(errors) == 1 and len(table) == 0


def test_memory_stays_bounded_over_many_requests():
    table = PendingTable(max_pending=100, recent_capacity=50)
    for i in range(20_000):
        table.add(str(i), far())
        table.take(str(i))
    assert len(table) == 0
    assert len(table._recent) == 50
    assert len(table._deadlines) <= 2 * len(table) + 65, "answered deadlines are compacted away"


def test_discarded_request_counts_as_failed():
    table = PendingTable(max_pending=2, recent_capacity=10)
    table.add("a", far())
    assert table.discard("a") is not None
    assert table.stats().failed == 1 and len(table) == 0


def test_settle_ignores_a_cancelled_future():
    future: Future = Future()
    future.cancel()
    settle(future, "late")
    assert future.cancelled()
    done: Future = Future()
    settle(done, error=TimeoutError("x"))
    assert isinstance(done.exception(), TimeoutError)


def test_duplicate_correlation_id_is_refused():
    table = PendingTable(max_pending=2, recent_capacity=10)
    table.add("a", far())
    with pytest.raises(ValueError):
        table.add("a", far())
