"""Phase drill, Keras ``ResumableFit.fit`` (``bench/notice/tf_drill.py`` describes the phases)."""

from __future__ import annotations

import random
from pathlib import Path

from bench.notice import tf_drill

PYTHON = "venv"
PHASES = ("startup", "step", "pydataset/w2", "pydataset/w4", "validation", "first-trace", "write")


def prepare(tmp: Path) -> dict:
    """The uninterrupted reference run."""
    return tf_drill.prepare(tmp, "keras")


def trial(root: Path, ctx: dict, *, phase: str, rng: random.Random) -> dict:
    """One notice inside ``phase`` and the resume to the end.

    Args:
        root: the trial's own empty directory (checkpoints, logs).
        ctx: what ``prepare`` returned, plus the runner's ``budget_s`` and ``resume``.
        phase: one of ``PHASES``.
        rng: the drill's random source (when in the phase the notice lands).

    Returns:
        the trial's figures (:func:`bench.notice.common.result`).
    """
    return tf_drill.trial(root, ctx, phase=phase, rng=rng, mode="keras")
