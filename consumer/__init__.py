"""kinference service: source -> intake -> request -> models -> batcher -> stages -> publisher -> delivery mode.

Read the modules in that order to follow a request through the service (README.md: How a request flows):

- ``source``      the poll thread: fetches records, commits, pauses and resumes partitions,
- ``intake``      tracks each record in the commit ledger, decodes it, admits and routes it,
- ``request``     turns a record into a ``Request`` value (routing headers, model, payload),
- ``models``      the served models: admission by the model's handler, then its batcher,
- ``batcher``     groups waiting requests into batches (``adaptive``, ``greedy`` or ``static`` policy),
- ``stages``      runs preprocess / inference / postprocess thread pools over micro-batches,
- ``publisher``   produces each request's answer (``answers``: reply and dead-letter records),
- ``at_least_once`` or ``exactly_once``: the delivery mode, which says what is produced when and when a request is
  answered for good: handed to the commit ledger (``commit``) whose offsets the source commits, or committed with
  its offsets in a transaction.

``service`` wires them together (``Service._build``) and owns start and stop; ``types`` holds the small shared
types; ``config`` the one config object; ``kinference.protocol`` is the wire format.
"""
