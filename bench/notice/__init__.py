"""The phase drill's per-framework modules (``bench/bench_notice.py`` is the harness).

Each module ``bench/notice/<name>.py`` starts its framework's trainer the way the node agent starts
one (:class:`spot_training.agent.process_group.ProcessGroup`: a session of its own) and sends the
notice the way the agent does (``ProcessGroup.stop``: SIGTERM to the whole group, SIGKILL only after
the notice budget). A module defines:

* ``PYTHON``: ``"venv"`` (``.venv/bin/python``: TensorFlow, MXNet) or ``"torch"``
  (``.venv-torch/bin/python``); the harness runs the module's trials in a process of that
  interpreter (``python -m bench.notice.run <module> ...``), so TensorFlow, MXNet and PyTorch never
  share a process;
* ``PHASES``: the phases its trials can land a notice in (``tuple[str, ...]``);
* ``prepare(tmp: Path) -> dict``: data and the uninterrupted reference run under ``tmp``; returns
  the context every trial gets (the runner adds ``budget_s``: the notice budget in seconds, and
  ``resume``: False in the short form, which skips the resume to the end and its comparison);
* ``trial(root: Path, ctx: dict, *, phase: str, rng: random.Random) -> dict``: one run and one
  notice at a random time inside ``phase`` (``root``: an empty directory of its own); returns
  :func:`bench.notice.common.result`'s keys.

The harness imports every module to read ``PYTHON`` and ``PHASES``: a module imports its framework
only inside its functions (or in the trainer it starts).
"""
