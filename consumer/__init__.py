"""kinference service: source -> intake -> request -> models -> runner (batcher -> stages) -> publisher -> delivery
mode.

Read the modules in that order to follow a request through the service (README.md: How a request flows):

- ``path.source``      the poll thread: fetches records, commits, pauses and resumes partitions,
- ``path.intake``      tracks each record in the commit ledger, decodes it, admits and routes it,
- ``path.request``     turns a record into a ``Request`` value (routing headers, model, payload),
- ``path.models``      the served models: admission by the model's handler, then its runner,
- ``path.runner``      one runner per model: a batch model's batcher and stages (next), or a generative model's
  engine (``path.generations``),
- ``path.batcher``     groups waiting requests into batches (``adaptive``, ``greedy`` or ``static`` policy),
- ``path.stages``      runs preprocess / inference / postprocess thread pools over micro-batches,
- ``delivery.publisher``  produces each request's answer (``delivery.answers``: reply and dead-letter records),
- ``delivery.at_least_once`` or ``delivery.exactly_once``: the delivery mode, which says what is produced when and
  when a request is answered for good: handed to the commit ledger (``ledger.commit``) whose offsets the source
  commits (``ledger.commits``), or committed with its offsets in a transaction.

The subpackages:

- ``path``         the request path above, from the poll to the stages, with what it consults on the way (flow
  control, admission, routing, rebalances, a share group's poll thread) and a generative model's runner
  (``generations``);
- ``delivery``     from a finished request to a durable answer: the publisher, what answers a request, the
  publisher's side of the two delivery modes, the member's transactional slot, which reply topics exist;
- ``ledger``       the floor below both, which they share and which imports neither: the ``Request``, the commit
  ledger, a share group's ledger, the byte budget, the poll thread's side of the two delivery modes;
- ``wire``         request values other than kinference's own JSON, and the bounds every value is read within:
  the Open Inference Protocol, Schema Registry formats, ``jsonscan``, ``schemabounds``, ``schemaids``; a generative
  model's OpenAI records (``openai``);
- ``accelerator``  one device process per GPU and the workers' links to it (batches, a generative engine), the
  shared memory between them, the start-up calibration;
- ``ops``          what operators run and watch: the CLI, the ``--workers`` supervisor, the HTTP endpoints, metrics,
  logs, lag, tracing, topic creation;
- ``brokers``      the local brokers of tests, benchmarks and ``make demo`` (embedded Tansu, Apache Kafka).

``service`` wires the path and delivery together (``Service._build``) and owns start and stop; ``types`` holds the
small shared types; ``config`` the one config object; ``kinference.protocol`` is the wire format. Imports point
down the floors that README.md lists and ``tests/unit/test_layout.py`` holds them to.
"""
