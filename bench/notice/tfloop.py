"""Phase drill, custom TensorFlow loop on ``TFCheckpointer`` (``bench/notice/tf_drill.py`` describes the phases)."""

from __future__ import annotations

import functools

from bench.notice import tf_drill

PYTHON = "venv"
PHASES = ("startup", "step", "validation", "first-trace", "write")

#: The module protocol (:mod:`bench.notice`): tf_drill's, in its ``tf`` mode.
prepare = functools.partial(tf_drill.prepare, mode="tf")
trial = functools.partial(tf_drill.trial, mode="tf")
