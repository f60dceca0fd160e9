"""One device process per GPU, fed by the workers (``--device-process``). Each module says by its name which process
it runs in:

- the device process: ``device_process`` its life (load, warm up, calibrate, serve), ``device_server`` the server that
  merges the workers' micro-batches, ``device_engine`` a generative model's engine;
- a worker: ``worker_link`` its side of a batch call (and the pipeline's inference port there), ``worker_engine_link``
  its side of a generative model's engine;
- both: ``wire`` every message between them and their one framing, ``arena`` the shared memory a batch call's tensors
  cross in, ``calibration`` the sizing of the device batch and the number of workers at start.

The device side imports nothing of the worker side, nor of ``consumer.path``.
"""
