"""Crash: SIGKILL a member three times under steady load and restart it each time (issue 4, item 1).

Checks, from the whole request and reply topics read at the end (see harness.audit): every request
has a reply; the extra replies come only from killed members (work they answered but had not
committed), at most one in-flight window per kill, and echo their request's own correlation id; the
client resolves each correlation id once and drops exactly the extra copies; one owner per partition
at a time, every reply from its partition's owner, no commit landing after a hand-over; the final
committed offsets equal the end offsets.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.harness import (
    CommitWatch,
    Group,
    Load,
    check,
    check_single_ownership,
    client_for,
    commit_regressions,
    end_run,
    final_commits,
)

pytestmark = [pytest.mark.integration, pytest.mark.faults]

COUNT = 10_000
RATE = 150.0  # requests per second: the load lasts about 67 s
KILLS = 3
KILL_EVERY_S = 9.0  # steady load between a recovery and the next kill
RECOVERY_S = 45.0  # dead member's session (6 s) + join (~3 s) + a restart, with room for a busy machine


@pytest.mark.timeout(240)
def test_sigkill_under_load_loses_nothing_and_duplicates_stay_in_the_window(fault_settings):
    settings = fault_settings()
    started = time.monotonic()
    recoveries = []
    with Group(settings) as group, CommitWatch(settings) as commits, client_for(settings) as client:
        group.start("a")
        group.start("b")
        group.wait_stable(RECOVERY_S)
        load = Load(client, RATE, COUNT).start()
        for kill in range(KILLS):
            time.sleep(KILL_EVERY_S)
            victim = group.live[0]  # the oldest live member: a, then b, then a's replacement
            victim.kill()
            group.start(f"{victim.name}{kill + 1}")
            recoveries.append(round(group.wait_stable(RECOVERY_S), 1))
        load.join(COUNT / RATE + 30)
        end = end_run(settings, group, load, client)
    exit_codes, result, skipped, stats = end.exit_codes, end.result, end.skipped, end.stats
    elapsed = time.monotonic() - started
    members = group.members
    killed = [m.name for m in members if m.killed]
    print(f"\ncrash: sent {load.sent}, {result.summary(members)}, client {stats}, reply records the broker "
          f"skipped for the client {len(skipped)}, recoveries {recoveries} s, assignments {group.assignments()}, "
          f"{elapsed:.0f} s")

    # Nothing lost: every request has a reply on the reply topic, echoing that very request.
    assert load.sent == COUNT and len(result.requests) == COUNT
    check(not result.lost, lambda: f"no reply for {[result.requests[c] for c in result.lost][:20]}\n{group.tails()}")
    assert not result.unknown and not result.errors, (result.unknown[:5], result.errors[:5])
    # Duplicates carry the request's own correlation id (the echo inside names the same seq) ...
    assert not result.mismatched, result.mismatched[:5]
    # ... come only from killed members (answered, not yet committed when they died), at most one
    # in-flight window each, and are never a member reprocessing its own work.
    duplicated_by = result.duplicated_by(members)
    assert set(duplicated_by) <= set(killed), duplicated_by
    assert all(n <= settings.window for n in duplicated_by.values()), (duplicated_by, settings.window)
    assert not result.repeated_by_survivor(members)
    assert not result.same_member_twice()
    # Ownership and commits: one owner at a time, replies only from the owner, no late commit.
    check_single_ownership(members)
    outside = result.outside_ownership(members)
    check(not outside, lambda: "replies outside their member's ownership:\n" + result.describe(outside, members))
    late = result.answered_after_commit(commits.samples)
    check(not late, lambda: "replies after a commit covered them:\n" + result.describe(late, members))
    assert not commit_regressions(commits.samples)
    assert final_commits(settings, result.ends) == result.ends
    assert set(exit_codes.values()) == {0}, (exit_codes, group.tails())
    assert elapsed < 150
