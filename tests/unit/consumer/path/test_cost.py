import math

import pytest

from kinference.consumer.path.cost import ArrivalRate, BatchCost


def test_batch_cost_recovers_fixed_and_per_unit_cost():
    cost = BatchCost()
    for work in [1, 4, 16, 64, 256] * 4:
        cost.observe(work, 0.005 + 0.0002 * work)
    fixed, per_unit = cost.fit()
    assert fixed == pytest.approx(0.005, rel=1e-6) and per_unit == pytest.approx(0.0002, rel=1e-6)
    assert cost.seconds(100) == pytest.approx(0.025, rel=1e-6)


def test_batch_cost_says_nothing_before_enough_batches_or_from_batches_of_one_size():
    cost = BatchCost(min_batches=8)
    for _ in range(4):
        cost.observe(32, 0.1)
    assert cost.fit() is None  # too few
    for _ in range(20):
        cost.observe(32, 0.1)
    assert cost.fit() is None and cost.seconds(32) is None  # one size: the fixed part is unknowable


def test_batch_cost_that_does_not_grow_with_size_is_all_fixed():
    cost = BatchCost()
    for work in [1, 8, 32, 2, 16] * 4:
        cost.observe(work, 0.010 - 0.00001 * work)
    fixed, per_unit = cost.fit()
    assert per_unit == 0.0 and fixed == pytest.approx(0.010 - 0.00001 * 11.8, rel=0.05)


def test_batch_cost_follows_a_changing_machine():
    cost = BatchCost(forget=0.9)
    for work in [1, 8, 32, 2, 16] * 10:
        cost.observe(work, 0.001 * work)
    for work in [1, 8, 32, 2, 16] * 20:
        cost.observe(work, 0.010 + 0.001 * work)
    assert cost.fit()[0] == pytest.approx(0.010, abs=0.001)


def test_arrival_rate_settles_at_the_steady_rate_and_decays_when_arrivals_stop():
    rate = ArrivalRate(window_s=1.0)
    assert rate.per_s(0.0) == 0.0
    now = 0.0
    for _ in range(5000):  # 500 per second for 10 s
        now += 0.002
        rate.add(now)
    assert rate.per_s(now) == pytest.approx(500, rel=0.01)
    assert rate.per_s(now + 1.0) == pytest.approx(500 / math.e, rel=0.01)
