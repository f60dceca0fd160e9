"""Slow model: one batch slower than ``max.poll.interval.ms`` (issue 4, item 6).

librdkafka requires ``max.poll.interval.ms >= session.timeout.ms``, so with the tests' 6 s session
the smallest poll interval is 6 s; 7 s is used and the slow batch takes 10 s. A member whose poll
loop waited for the model would leave the group after 7 s (librdkafka: "Application maximum poll
interval exceeded"), its partitions would move and their in-flight requests be answered twice.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.harness import Group, Load, audit, check, check_client, client_for, final_commits, now_ms

pytestmark = [pytest.mark.integration, pytest.mark.faults]

MAX_POLL_INTERVAL_MS = 7000
STALL_S = 10.0
RATE = 50.0
COUNT = 750  # 15 s of load


@pytest.mark.timeout(120)
def test_batch_slower_than_max_poll_interval_causes_no_rebalance_and_no_duplicates(fault_settings):
    settings = fault_settings(extra=("--kafka-consumer", f"max.poll.interval.ms={MAX_POLL_INTERVAL_MS}"))
    started = time.monotonic()
    with Group(settings) as group, client_for(settings) as client:
        group.start("a")
        group.start("b")
        group.wait_stable(40)
        stable_ms = now_ms()
        load = Load(client, RATE, COUNT).start()
        time.sleep(2)
        slow = client.send({"seq": -1, "stall_s": STALL_S}, key="slow")
        load.join(COUNT / RATE + 10)
        slow_reply = slow.result(60)
        outcomes = load.wait_answered(60)
        stop_ms = now_ms()
        exit_codes = group.stop_all(30)
        result = audit(settings, load.sent + 1)
        skipped = check_client(client, result, outcomes, settings.broker_kind)
        stats = client.stats()
    elapsed = time.monotonic() - started
    members = group.members
    slow_member = next(m.name for m in members if m.pid == slow_reply.result()["pid"])
    changes = [(m.name, e) for m in members for e in m.events if stable_ms <= e.ms <= stop_ms]
    print(f"\nslow model: sent {load.sent + 1}, {result.summary(members)}, client {stats}, slow batch "
          f"{slow_reply.inference_ms:.0f} ms on {slow_member}, rebalances after start {len(changes)}, "
          f"reply records the broker skipped for the client {len(skipped)}, {elapsed:.0f} s")

    # The stall really outlasted max.poll.interval.ms ...
    assert slow_reply.result()["value"] == {"seq": -1, "stall_s": STALL_S}
    assert slow_reply.inference_ms is not None and slow_reply.inference_ms >= MAX_POLL_INTERVAL_MS
    # ... yet no member left the group or lost a partition until the test stopped them,
    check(not changes, lambda: f"rebalance during the stall: {changes}\n{group.tails()}")
    assert not any("poll interval" in line.lower() for m in members for line in m.lines), group.tails()
    # and every request was answered exactly once.
    assert not result.lost and not result.unknown and not result.errors and not result.mismatched
    assert result.duplicates == 0 and stats.duplicates == 0, result.summary(members)
    assert final_commits(settings, result.ends) == result.ends
    assert set(exit_codes.values()) == {0}, (exit_codes, group.tails())
