"""Delivery: from a finished request to a durable answer.

``publisher`` (one producer thread) produces each request's answer (``answers``: its reply and dead-letter records)
and calls its delivery mode, one of ``at_least_once`` (answered once acknowledged; the poll thread commits past it,
by the ledger) or ``exactly_once`` (answers and offsets in one transaction). Each mode's poll-thread side, and the
ledger, are on the floor below (``kinference.consumer.ledger``), which this package uses and never the request path.
``member_slot`` holds a host's stable ``transactional.id``; ``topic_metadata`` which reply topics exist.
"""
