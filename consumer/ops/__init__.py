"""Operations: what operators run and watch. ``cli`` (``kinference serve``, ``topics``, ``healthcheck``,
``broker``), ``supervisor`` (``--workers N`` and the device processes), ``endpoints`` (``/metrics``, ``/healthz``,
``/readyz``), ``metrics``, ``logs``, ``lag``, ``tracing`` and ``topics`` (creation)."""
