"""The phase drill's per-framework modules (``bench/bench_notice.py`` is the harness).

Each module ``bench/notice/<name>.py`` starts its framework's trainer the way the node agent starts
one (:class:`spot_training.agent.process_group.ProcessGroup`: a session of its own) and sends the
notice the way the agent does (``ProcessGroup.stop``: SIGTERM to the whole group, SIGKILL only after
the notice budget). A module implements :class:`bench.notice.common.FrontEnd` (``PYTHON``, ``PHASES``,
``prepare`` and ``trial``, documented there once); the harness runs the module's trials in a process
of its ``PYTHON`` interpreter (``python -m bench.notice.run <module> ...``), so TensorFlow, MXNet and
PyTorch never share a process.

The harness imports every module to read ``PYTHON`` and ``PHASES``: a module imports its framework
only inside its functions (or in the trainer it starts).
"""
