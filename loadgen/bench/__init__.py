"""The benchmarks: kinference against its ceilings and against consumers written the way users write them.

The commands, one module each:

- ``bench``      ``kinference bench``: every text scenario side by side through one local broker;
- ``image``      ``kinference bench image``: image classification, stage threads against a pipelined ceiling;
- ``gpu``        ``kinference bench gpu``: each model's ceilings and ``serve`` drains, GPU busy and CPU per message;
- ``drain``      ``kinference drain``: how fast each contender drains a backlog, and where its time goes;
- ``cpu_paths``  ``kinference cpu-paths``: the embedding handler's CPU options, speed and accuracy.

What they share:

- ``baselines``  plain confluent-kafka loops, the contenders kinference is compared with;
- ``contender``  a contender in a child process of its own; ``serve`` what it runs (kinference or a loop);
- ``ceiling``    the handler (or the plain model) called in a loop in this process, with no Kafka;
- ``model_dirs`` the models ``bench gpu`` measures: directories or presets, random weights from a config;
- ``gpu_busy``   a GPU's busy fraction from NVML, sampled in a thread;
- ``machine``    the machine a run was on, and the CPU time its processes spent;
- ``outputs``    tables on the console, the JSON report and its Markdown;
- ``command``    the commands' options from the command line, and a run that fails in one line.

The load generator these drive (``Client``, ``runner``, ``report``) is ``kinference.loadgen``'s.
"""
