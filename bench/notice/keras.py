"""Phase drill, Keras ``ResumableFit.fit`` (``bench/notice/tf_drill.py`` describes the phases)."""

from __future__ import annotations

import functools

from bench.notice import tf_drill

PYTHON = "venv"
PHASES = ("startup", "step", "pydataset/w2", "pydataset/w4", "validation", "first-trace", "write")

#: The module protocol (:mod:`bench.notice`): tf_drill's, in its ``keras`` mode.
prepare = functools.partial(tf_drill.prepare, mode="keras")
trial = functools.partial(tf_drill.trial, mode="keras")
