"""One device process per GPU, fed by the workers (``--device-process``).

``device_process`` is its life (load, warm up, calibrate, serve); ``device`` the server that merges the workers'
micro-batches; ``device_link`` a worker's side of a batch call, over ``arena`` (shared memory); ``device_engine`` and
``engine_link`` the same for a generative model's engine; ``calibration`` sizes the device batch and the number of
workers at start.
"""
