"""The request path: a record polled from Kafka, decoded, admitted, batched and run through the stages.

In the order a request runs it: ``source`` (or ``share`` for a share group) -> ``intake`` -> ``request`` ->
``models`` -> ``runner`` (one per model: a batch model's ``batcher`` -> ``stages``; a generative model's
``generations``). Consulted on the way: ``flow`` (how much is in flight), ``rebalance``, ``control`` (cancels),
``router``, ``admission``, ``cost`` (the adaptive policy's estimates). Then ``kinference.consumer.delivery``. The
ledgers it tracks each request in, and the byte budget, are on the floor below (``kinference.consumer.ledger``).
"""
