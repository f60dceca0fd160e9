"""``metrics.observe_many`` leaves a histogram exactly as ``observe`` of each amount would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from kinference.consumer.ops.metrics import observe_many


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for metric in registry.collect() for sample in metric.samples if not sample.name.endswith("_created")}


def test_observe_many_equals_observe_of_each() -> None:
    amounts = [0.0, 0.0004, 0.0005, 0.0007, 0.01, 0.3, 0.3, 2.0, 29.0, 31.0, 1e9]
    one_by_one, batched = CollectorRegistry(), CollectorRegistry()
    single, many = (Histogram("wait_seconds", "", ["topic"], buckets=(0.0005, 0.001, 0.01, 0.5, 30.0),
                              registry=registry) for registry in (one_by_one, batched))
    for amount in amounts:
        single.labels("t").observe(amount)
    observe_many(many.labels("t"), amounts)
    observe_many(many.labels("t"), [])
    assert _samples(batched) == _samples(one_by_one)
