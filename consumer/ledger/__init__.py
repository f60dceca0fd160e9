"""The ground floor: the ``Request`` every wing hands on, and the books kept of it, below the request path
(``path``) and delivery (``delivery``), which both use it and neither of which it imports.

``request`` (the value that travels through the service), ``commit`` (the commit ledger: an offset is committed
only once its request is answered), ``share`` (a share group's ledger: each record acknowledged once answered),
``budget`` (the bytes the requests in flight hold decoded) and ``commits`` (the poll thread's side of both delivery
modes: ``OffsetCommits``, ``TransactionCommits``). The intake charges and tracks each record here; the delivery
modes hand each answered request back here; the source commits from here.
"""
