"""Graceful shutdown: SIGTERM under load drains, commits and exits 0; a restart answers nothing twice
(issue 4, item 8)."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from tests.faults.harness import Group, Load, client_for, end_run, final_commits, now_ms

pytestmark = [pytest.mark.integration, pytest.mark.faults]

GRACE_S = 20.0
RATE = 300.0  # above the handler's ~160 requests/s (batches of 8, 50 ms each): work piles up
COUNT = 1800
SIGTERM_AFTER_S = 2.5


@pytest.mark.timeout(120)
def test_sigterm_under_load_drains_commits_and_restart_answers_nothing_twice(fault_settings):
    settings = fault_settings(extra=("--handler-options", "delay_s=0.05", "--max-batch-size", "8",
                                     "--shutdown-grace-s", str(GRACE_S)))
    started = time.monotonic()
    with Group(settings) as group, client_for(settings) as client:
        first = group.start("first")
        group.wait_stable(40)
        load = Load(client, RATE, COUNT).start()
        time.sleep(SIGTERM_AFTER_S)
        sigterm_ms = now_ms()
        first.terminate()
        exit_code = first.wait_exit(GRACE_S + 10)
        drain_s = (first.ended_ms - sigterm_ms) / 1000
        partitions = range(settings.partitions)
        committed_at_exit = {p: max(0, o) for p, o in final_commits(settings, dict.fromkeys(partitions)).items()}
        group.start("restart")
        group.wait_stable(40)
        load.join(COUNT / RATE + 10)
        end = end_run(settings, group, load, client)
    exit_codes, result, skipped, stats = end.exit_codes, end.result, end.skipped, end.stats
    elapsed = time.monotonic() - started
    members = group.members
    answered: dict[str, dict[int, set[int]]] = {m.name: defaultdict(set) for m in members}
    names = {m.pid: m.name for m in members}
    for cid, answers in result.by_request.items():
        sent = result.requests[cid]
        for answer in answers:
            answered[names[answer.pid]][sent.partition].add(sent.offset)
    drained = sum(a.pid == first.pid and a.ms > sigterm_ms for a in result.answers)
    print(f"\nshutdown: sent {load.sent}, {result.summary(members)}, client {stats}, SIGTERM -> exit "
          f"{drain_s:.1f} s with {drained} replies after the signal, committed at exit {committed_at_exit}, "
          f"reply records the broker skipped for the client {len(skipped)}, {elapsed:.0f} s")

    # SIGTERM: exit 0 within the grace period, having finished its in-flight work ...
    assert exit_code == 0, first.tail()
    assert first.said("received SIGTERM") and not first.said("grace"), first.tail()
    assert drain_s < GRACE_S
    assert drained > 0, "nothing was in flight at SIGTERM: the test did not exercise draining"
    # ... and committed exactly what it answered: per partition, a prefix of the offsets.
    for partition in partitions:
        mine = answered["first"][partition]
        assert mine == set(range(committed_at_exit[partition])), (partition, committed_at_exit)
    # The restart resumes at the commits and answers nothing the first process answered.
    for partition in partitions:
        assert answered["restart"][partition] == set(range(committed_at_exit[partition], result.ends[partition]))
    assert not result.lost and not result.unknown and not result.errors and not result.mismatched
    assert result.duplicates == 0 and stats.duplicates == 0
    assert final_commits(settings, result.ends) == result.ends
    assert exit_codes == {"restart": 0}
