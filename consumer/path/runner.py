"""A model's runner: what takes its requests from the intake and computes them, one interface (``Runner``) for the two
ways of serving, chosen once where the model is built (``models.Models.build``):

- ``BatchRunner`` (here): the batcher, the waiting room (``batcher``), and the stage threads that pull batches from it
  (``stages``); the requests leave through the publisher, finished;
- ``generations.GenerativeRunner``: admission to the model's engine, the engine (in this process or the device
  process), and the drain thread that turns its events into stream chunks and finals.

Both take a fetch's requests for their model in one ``put``, through the model's ``admission.Admission``: the handler
validates and prices them, and those past the model's share of ``max_in_flight`` are refused, before any waits.

Entered from the poll thread (``put``, ``discard``, and ``cancel`` from the control topic's reader) and from the
thread that starts and stops the service; the runner's own threads do the rest.
"""

from __future__ import annotations

from typing import Protocol

from kinference.consumer.ledger.request import Request
from kinference.consumer.path.admission import Admission
from kinference.consumer.path.batcher import Batcher
from kinference.consumer.path.stages import Pipeline
from kinference.consumer.types import PartitionKey


class Runner(Protocol):
    """One model's requests, from admission to their answer (handed to the publisher)."""

    def put(self, requests: list[Request]) -> None:
        """Take a fetch's requests for this model (the poll thread), in one call: admit them (``Admission``) and
        queue those admitted; the others are answered at once. Never raises."""

    def discard(self, partitions: list[PartitionKey]) -> list[Request]:
        """The requests of revoked partitions that are not computed yet, taken out (none answered here)."""

    def cancel(self, correlation_id: str) -> None:
        """A cancel from the control topic: the request it names ends early, if this runner can end it."""

    @property
    def held(self) -> int:
        """Requests taken and not yet handed on to be answered: what counts against the model's share of
        ``max_in_flight``."""

    def start(self) -> None:
        """Start its threads; returns once the model is ready to compute."""

    def close(self) -> None:
        """Nothing more is put: what waits stays, unanswered, for the next owner."""

    def stop(self, timeout_s: float) -> bool:
        """Stop its threads; False when they did not stop in time (a handler call that does not return)."""

    @property
    def healthy(self) -> bool: ...

    @property
    def stuck(self) -> str | None:
        """Why it is not healthy, in words; None when it is."""

    @property
    def replacing(self) -> bool:
        """Unhealthy only while it repairs itself (an engine replacing itself): the process goes on meanwhile."""


class BatchRunner:
    """A batch model's runner: its batcher and its stage threads, which pull their batches from it."""

    def __init__(self, admission: Admission, batcher: Batcher, pipeline: Pipeline) -> None:
        self.admission = admission
        self.batcher = batcher
        self.pipeline = pipeline

    def put(self, requests: list[Request]) -> None:
        self.admission.put(requests, self.held, self.batcher.put)

    def discard(self, partitions: list[PartitionKey]) -> list[Request]:
        """The batcher's waiting requests: what the stages hold already runs to its end."""
        return self.batcher.discard(partitions)

    def cancel(self, correlation_id: str) -> None:
        """A batch request is computed in one go, a batch at a time: there is nothing to end early."""

    @property
    def held(self) -> int:
        return self.batcher.waiting + self.pipeline.in_progress

    def start(self) -> None:
        self.pipeline.start()

    def close(self) -> None:
        self.batcher.close()

    def stop(self, timeout_s: float) -> bool:
        return self.pipeline.stop(timeout_s)

    @property
    def healthy(self) -> bool:
        return self.pipeline.healthy

    @property
    def stuck(self) -> str | None:
        return self.pipeline.stuck

    @property
    def replacing(self) -> bool:
        """Stage threads do not replace themselves: a hung one stays unhealthy."""
        return False
