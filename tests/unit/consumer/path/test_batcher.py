import threading
import time

import pytest

from kinference.consumer.config import Batching
from kinference.consumer.path.batcher import Batcher
from tests.fakes import make_request


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limits(policy, size, delay_ms, **others):
    """Batching of this policy, size and delay, with no token or byte budget unless ``others`` give one."""
    return Batching(batch_policy=policy, max_batch_size=size, max_batch_delay_ms=delay_ms,
                    **{"max_batch_tokens": None, "max_batch_bytes": None, **others})


def make_batcher(policy="static", size=4, delay_ms=50.0, clock=None, epoch_ms=lambda: 0.0):
    rejected = []
    batcher = Batcher(limits(policy, size, delay_ms), rejected.extend, clock=clock or Clock(), epoch_ms=epoch_ms)
    return batcher, rejected


def test_static_waits_for_delay_counted_from_oldest_arrival():
    clock = Clock()
    batcher, _ = make_batcher("static", size=4, delay_ms=50, clock=clock)
    assert batcher.wait_s(clock.now) is None
    batcher.put([make_request(received=90.0)])  # arrived 10 s before the batcher saw it? delay counts from arrival
    batcher.put([make_request(received=100.0)])
    assert batcher.wait_s(clock.now) == 0.0  # the oldest has waited far more than 50 ms already

    fresh, _ = make_batcher("static", size=4, delay_ms=50, clock=clock)
    fresh.put([make_request(received=100.0)])
    fresh.put([make_request(received=100.02)])
    assert fresh.wait_s(100.0) == pytest.approx(0.05)
    assert fresh.wait_s(100.03) == pytest.approx(0.02)
    assert fresh.wait_s(100.05) == 0.0


def test_static_dispatches_full_batch_at_once_and_caps_size():
    clock = Clock()
    batcher, _ = make_batcher("static", size=4, delay_ms=50, clock=clock)
    for _ in range(6):
        batcher.put([make_request(received=clock.now)])
    assert batcher.wait_s(clock.now) == 0.0
    batch = batcher.next_batch(0.0)
    assert len(batch) == 4 and all(r.batch_size == 4 and r.dispatched == clock.now for r in batch)
    assert batcher.wait_s(clock.now) == pytest.approx(0.05)  # the remaining 2 wait for the delay


def test_static_next_batch_times_out_with_empty_list_before_delay():
    batcher, _ = make_batcher("static", size=4, delay_ms=10_000, clock=time.monotonic)
    batcher.put([make_request(received=time.monotonic())])
    started = time.monotonic()
    assert batcher.next_batch(0.05) == []
    assert 0.04 <= time.monotonic() - started < 1.0


def test_static_real_clock_sends_partial_batch_when_delay_runs_out():
    batcher, _ = make_batcher("static", size=8, delay_ms=60, clock=time.monotonic)
    arrival = time.monotonic()
    batcher.put([make_request(received=arrival)])
    batch = batcher.next_batch(2.0)
    waited = time.monotonic() - arrival
    assert len(batch) == 1
    assert 0.055 <= waited < 0.5


def test_greedy_never_holds_a_lone_request():
    clock = Clock()
    batcher, _ = make_batcher("greedy", size=32, delay_ms=1000, clock=clock)
    batcher.put([make_request(received=clock.now)])
    assert batcher.wait_s(clock.now) == 0.0
    assert len(batcher.next_batch(0.0)) == 1


def test_greedy_takes_everything_waiting_up_to_max():
    clock = Clock()
    batcher, _ = make_batcher("greedy", size=5, clock=clock)
    for _ in range(7):
        batcher.put([make_request(received=clock.now)])
    assert [len(batcher.next_batch(0.0)) for _ in range(2)] == [5, 2]


def test_expired_requests_are_rejected_not_batched():
    batcher, rejected = make_batcher("greedy", epoch_ms=lambda: 1_000.0)
    batcher.put([make_request(deadline_ms=999)])  # already expired on arrival
    live = make_request(deadline_ms=5_000)
    batcher.put([live])
    assert [r.error.code for r in rejected] == ["deadline_exceeded"]
    assert batcher.next_batch(0.0) == [live]


def test_requests_expiring_while_queued_are_rejected_at_dispatch():
    now_ms = [1_000.0]
    batcher, rejected = make_batcher("greedy", epoch_ms=lambda: now_ms[0])
    doomed, survivor = make_request(deadline_ms=1_500), make_request(deadline_ms=9_000)
    batcher.put([doomed])
    batcher.put([survivor])
    now_ms[0] = 2_000.0
    assert batcher.next_batch(0.0) == [survivor]
    assert rejected == [doomed] and doomed.error.code == "deadline_exceeded"


def test_discard_removes_only_revoked_partitions():
    batcher, _ = make_batcher("greedy", size=10)
    keep = [make_request(partition=0) for _ in range(3)]
    drop = [make_request(partition=1) for _ in range(2)]
    for request in [keep[0], drop[0], keep[1], drop[1], keep[2]]:
        batcher.put([request])
    assert batcher.discard([("requests", 1)]) == drop
    assert batcher.next_batch(0.0) == keep


def test_close_wakes_a_waiting_consumer():
    batcher, _ = make_batcher("static", clock=time.monotonic)
    result = []
    waiter = threading.Thread(target=lambda: result.append(batcher.next_batch(10.0)))
    waiter.start()
    time.sleep(0.05)
    batcher.close()
    waiter.join(2.0)
    assert not waiter.is_alive() and result == [[]]


@pytest.mark.parametrize("kwargs", [{"policy": "fifo"}, {"size": 0}])
def test_invalid_arguments_fail_at_construction(kwargs):
    with pytest.raises(ValueError):
        make_batcher(**kwargs)


def test_batches_stop_at_max_batch_bytes_but_take_at_least_one():
    clock = Clock()
    rejected = []
    batcher = Batcher(limits("greedy", 10, 0, max_batch_bytes=10), rejected.extend, clock=clock)
    for size in (4, 4, 4, 30, 1):
        request = make_request(received=clock.now)
        request.value = b"x" * size
        batcher.put([request])
    assert [[len(r.value) for r in batcher.next_batch(0.0)] for _ in range(3)] == [[4, 4], [4], [30]]
    assert [len(r.value) for r in batcher.next_batch(0.0)] == [1]


def test_static_batch_is_due_when_waiting_bytes_reach_the_limit():
    clock = Clock()
    batcher = Batcher(limits("static", 10, 1000, max_batch_bytes=8), [].extend, clock=clock)
    request = make_request(received=clock.now)
    request.value = b"x" * 8
    batcher.put([request])
    assert batcher.wait_s(clock.now) == 0.0


def test_requests_older_than_max_queue_ms_are_shed_as_overloaded():
    clock = Clock()
    now_ms = [10_000.0]
    rejected = []
    batcher = Batcher(limits("greedy", 10, 0), rejected.extend, max_queue_ms=500, clock=clock,
                      epoch_ms=lambda: now_ms[0])
    stale_in_kafka = make_request(received=clock.now)
    stale_in_kafka.timestamp_ms = 9_000.0  # written to Kafka 1 s ago: shed on arrival
    batcher.put([stale_in_kafka])
    fresh = make_request(received=clock.now)
    fresh.timestamp_ms = 9_900.0
    batcher.put([fresh])
    untimed = make_request(received=clock.now)  # no record timestamp: age counts from receipt
    batcher.put([untimed])
    assert rejected == [stale_in_kafka] and stale_in_kafka.error.code == "overloaded"
    assert "max_queue_ms is 500" in stale_in_kafka.error.message

    now_ms[0] = 10_450.0
    clock.now += 0.6  # untimed has now waited 600 ms, fresh 550 ms: both shed at dispatch
    assert batcher.next_batch(0.0) == []
    assert rejected == [stale_in_kafka, fresh, untimed]


def test_expired_requests_do_not_take_places_in_the_batch():
    now_ms = [1_000.0]
    rejected = []
    batcher = Batcher(limits("greedy", 3, 0), rejected.extend, clock=Clock(), epoch_ms=lambda: now_ms[0])
    doomed = [make_request(deadline_ms=1_500) for _ in range(3)]
    live = [make_request() for _ in range(4)]
    for request in [doomed[0], live[0], doomed[1], doomed[2], live[1], live[2], live[3]]:
        batcher.put([request])
    now_ms[0] = 2_000.0
    assert batcher.next_batch(0.0) == live[:3]  # full, though three expired requests were in the way
    assert rejected == doomed


def tokened(tokens, received=100.0, **kwargs):
    request = make_request(received=received, **kwargs)
    request.tokens = tokens
    return request


def take_tokens(batcher):
    return [r.tokens for r in batcher.next_batch(0.0)]


def test_token_budget_groups_waiting_requests_by_length_around_the_oldest():
    batcher = Batcher(limits("greedy", 4, 0, max_batch_tokens=1000), [].extend, clock=Clock())
    for tokens in (12, 200, 10, 180, 11, 190, 9, 220, 13):
        batcher.put([tokened(tokens)])
    # The oldest (12) goes first, with the three waiting requests nearest to it in length.
    assert sorted(take_tokens(batcher)) == [10, 11, 12, 13]
    # Now the oldest is 200; 4 x 220 = 880 fits the budget.
    assert sorted(take_tokens(batcher)) == [180, 190, 200, 220]
    assert take_tokens(batcher) == [9]
    assert batcher.waiting == 0


def test_token_budget_bounds_longest_times_count_and_a_request_over_it_runs_alone():
    batcher = Batcher(limits("greedy", 32, 0, max_batch_tokens=100), [].extend, clock=Clock())
    for tokens in (30, 30, 30, 30, 500, 30):
        batcher.put([tokened(tokens)])
    assert take_tokens(batcher) == [30, 30, 30]  # 4 x 30 = 120 > 100
    assert sorted(take_tokens(batcher)) == [30, 30]
    assert take_tokens(batcher) == [500]  # over the budget: alone, never stuck


def test_length_groups_do_not_mix_short_and_long_requests():
    batcher = Batcher(limits("greedy", 32, 0, max_batch_tokens=100_000), [].extend, clock=Clock())
    for tokens in (256, 10, 12, 120):
        batcher.put([tokened(tokens)])
    # 120 is within 2 x + slack of 256, the short ones are not: padding them to 256 would cost
    # more than a batch of their own.
    assert sorted(take_tokens(batcher)) == [120, 256]
    assert sorted(take_tokens(batcher)) == [10, 12]


def test_no_request_is_starved_by_a_stream_of_other_lengths():
    batcher = Batcher(limits("greedy", 4, 0, max_batch_tokens=10_000), [].extend, clock=Clock())
    batcher.put([tokened(250)])
    served_long_after = None
    for round_ in range(10):
        for _ in range(8):
            batcher.put([tokened(10)])
        if 250 in take_tokens(batcher):
            served_long_after = round_
            break
    assert served_long_after == 0  # the oldest request is in the very next batch


def test_without_token_budget_batches_stay_first_in_first_out():
    batcher = Batcher(limits("greedy", 3, 0), [].extend, clock=Clock())
    for tokens in (12, 200, 10, 180):
        batcher.put([tokened(tokens)])
    assert take_tokens(batcher) == [12, 200, 10]


def test_grouped_batches_still_shed_expired_requests_and_discard_revoked_partitions():
    now_ms = [1_000.0]
    rejected = []
    batcher = Batcher(limits("greedy", 8, 0, max_batch_tokens=10_000), rejected.extend, clock=Clock(),
                      epoch_ms=lambda: now_ms[0])
    doomed = tokened(20, deadline_ms=1_500)
    revoked = tokened(21, partition=1)
    kept = [tokened(t) for t in (19, 22)]
    for request in [kept[0], doomed, revoked, kept[1]]:
        batcher.put([request])
    assert batcher.discard([("requests", 1)]) == [revoked]
    now_ms[0] = 2_000.0
    assert batcher.next_batch(0.0) == kept
    assert rejected == [doomed] and batcher.waiting == 0


def learned(batcher, fixed_s, per_unit_s, works=(1, 2, 4, 8, 16, 32)):
    for _ in range(3):
        for work in works:
            batcher.observe(work, fixed_s + per_unit_s * work)


def test_adaptive_dispatches_at_once_until_it_has_learned_the_batch_cost():
    clock = Clock()
    batcher = Batcher(limits("adaptive", 32, 50), [].extend, clock=clock)
    for _ in range(5):
        batcher.put([make_request(received=clock.now)])
    assert batcher.wait_s(clock.now) == 0.0


def busy_gpu_like(clock, max_batch_delay_ms, target_latency_ms):
    """An adaptive batcher that has learned a GPU-like cost (batches are nearly free to grow) and has
    seen 1000 requests/s for the last second."""
    batcher = Batcher(limits("adaptive", 64, max_batch_delay_ms, target_latency_ms=target_latency_ms), [].extend,
                      clock=clock)
    learned(batcher, fixed_s=0.020, per_unit_s=0.0001)
    for _ in range(1000):
        clock.now += 0.001
        batcher.arrivals.add(clock.now)
    return batcher


def test_adaptive_holds_a_batch_while_arrivals_in_one_fixed_cost_outnumber_the_waiting():
    clock = Clock()
    batcher = busy_gpu_like(clock, max_batch_delay_ms=50, target_latency_ms=200)
    batcher.put([make_request(received=clock.now)])
    # ~20 arrive per fixed cost, 1 waits: hold until they are expected, bounded by max_batch_delay_ms.
    hold = batcher.wait_s(clock.now)
    assert 0.005 < hold <= 0.05
    for _ in range(25):
        batcher.put([make_request(received=clock.now)])
    assert batcher.wait_s(clock.now) == 0.0


def test_adaptive_never_holds_past_the_latency_target_or_at_low_load():
    clock = Clock()
    batcher = busy_gpu_like(clock, max_batch_delay_ms=1000, target_latency_ms=30)
    batcher.put([make_request(received=clock.now - 0.005)])
    # The oldest came 5 ms ago and its batch takes >= 20 ms: at most ~5 ms more may pass.
    assert batcher.wait_s(clock.now) <= 0.0051

    quiet = Batcher(limits("adaptive", 64, 1000, target_latency_ms=1000), [].extend, clock=clock)
    learned(quiet, fixed_s=0.020, per_unit_s=0.0001)
    quiet.arrivals.add(clock.now - 0.5)  # one request in the last second: nothing to wait for
    quiet.put([make_request(received=clock.now)])
    assert quiet.wait_s(clock.now) == 0.0


def test_adaptive_on_cpu_like_cost_behaves_greedy():
    clock = Clock()
    batcher = Batcher(limits("adaptive", 64, 50), [].extend, clock=clock)
    learned(batcher, fixed_s=0.001, per_unit_s=0.003)  # cost grows with size: waiting cannot pay off
    for _ in range(100):
        clock.now += 0.01
        batcher.arrivals.add(clock.now)
    batcher.put([make_request(received=clock.now)])
    assert batcher.wait_s(clock.now) == 0.0


def test_while_only_full_batches_may_go_a_partial_one_waits_until_woken():
    """The pipeline's prefetch: with every inference thread busy it takes only a full batch; a partial one stays
    in the batcher (its deadlines still checked there) until ``wake`` says a thread is free."""
    batcher, _ = make_batcher("greedy", size=4, clock=time.monotonic)
    busy = threading.Event()
    busy.set()
    batcher.put([make_request(received=time.monotonic())])
    assert batcher.next_batch(0.05, busy.is_set) == []
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(batcher.next_batch(10.0, busy.is_set)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()
    busy.clear()
    batcher.wake()
    waiter.join(2)
    assert not waiter.is_alive() and len(result[0]) == 1
    for _ in range(4):
        batcher.put([make_request(received=time.monotonic())])
    busy.set()
    assert len(batcher.next_batch(0.0, busy.is_set)) == 4  # a full batch goes even so


class CountingCondition(threading.Condition):
    """A condition that counts its notifications (``notify_all`` notifies through ``notify``)."""

    notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def test_a_fetch_put_in_one_call_wakes_the_stages_once_for_all_of_its_requests():
    """Issue 27: a backlog's poll put hundreds of requests, each waking the dispatcher to look (a lock and a GIL
    hand-off each); issue 38: the batcher takes a whole fetch in one call, one lock and one wake."""
    batcher, _ = make_batcher("greedy", size=8, clock=time.monotonic)
    batcher._cond = condition = CountingCondition()
    batcher.put([make_request(received=time.monotonic()) for _ in range(3)])
    assert condition.notified == 1
    assert len(batcher.next_batch(0.1)) == 3
    batcher.put([make_request(received=time.monotonic())])  # alone: wakes at once, as before
    assert condition.notified == 2
