"""kinference service: source -> batcher -> stages -> publisher -> commit.

Read the modules in that order to follow a request through the service:

- ``source``     polls the consumer group and turns records into ``Request`` values,
- ``batcher``    groups waiting requests into batches (``adaptive``, ``greedy`` or ``static`` policy),
- ``stages``     runs preprocess / inference / postprocess thread pools over micro-batches,
- ``publisher``  produces keyed replies (and dead letters) with an idempotent producer,
- ``commit``     commits, per partition, only offsets whose replies the broker acknowledged.

``service`` wires them together; ``protocol`` is the wire format; ``config`` the one config object.
"""
