"""Delivery: from a finished request to a durable answer.

``publisher`` (one producer thread) produces each request's answer and calls its delivery mode, one of
``at_least_once`` (answered once acknowledged; the poll thread commits past it, by the ledger in ``commit``) or
``exactly_once`` (answers and offsets in one transaction). ``member_slot`` holds a host's stable
``transactional.id``; ``topic_metadata`` which reply topics exist.
"""
