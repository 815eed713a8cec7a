"""Phase drill, custom TensorFlow loop on ``TFCheckpointer`` (``bench/notice/tf_drill.py`` describes the phases)."""

from __future__ import annotations

from pathlib import Path

from bench.notice import tf_drill
from bench.notice.tf_drill import trial  # noqa: F401 (the FrontEnd's trial: the mode comes from prepare)

PYTHON = "venv"
PHASES = ("startup", "step", "validation", "first-trace", "write")


def prepare(tmp: Path) -> dict:
    """The uninterrupted reference run's place; trials run ``tf_job.py tf``.

    Implements :meth:`bench.notice.common.FrontEnd.prepare`.
    """
    return tf_drill.prepare(tmp, "tf")
