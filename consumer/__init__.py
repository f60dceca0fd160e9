"""kinference service: source -> intake -> request -> models -> batcher -> stages -> publisher -> checkpoint.

Read the modules in that order to follow a request through the service (README.md: How a request flows):

- ``source``      the poll thread: fetches records, commits, pauses and resumes partitions,
- ``intake``      tracks each record in the commit ledger, decodes it, admits and routes it,
- ``request``     turns a record into a ``Request`` value (routing headers, model, payload),
- ``models``      the served models: admission by the model's handler, then its batcher,
- ``batcher``     groups waiting requests into batches (``adaptive``, ``greedy`` or ``static`` policy),
- ``stages``      runs preprocess / inference / postprocess thread pools over micro-batches,
- ``publisher``   produces each request's answer (``answers``: reply and dead-letter records),
- ``checkpoint``  makes answers durable: offsets committed (``commit``) or a transaction (``transactions``).

``service`` wires them together and owns start and stop; ``types`` holds the small shared types; ``config`` the
one config object; ``kinference.protocol`` is the wire format.
"""
