"""Phase-drill trials shared by the Keras ``fit`` and TF-loop modules (``bench/notice/tf_job.py`` trains).

Phases: ``startup`` (1-3 s after start: the TensorFlow import and the restore of a checkpoint an
earlier run of one epoch left), ``step`` (after 3-25 of 30 steps), ``pydataset/wN`` (Keras: the same
with a ``PyDataset`` of N worker processes), ``validation`` (inside a validation pass 150/110 times
the notice budget, at a time that leaves more than the budget of it to run), ``first-trace`` (0-1 s
after ``PHASE fit``: the first ``tf.function`` trace), ``write`` (a checkpoint after every step, so a
background write is in flight). After the notice the run is resumed to the end and its variables are
compared with the uninterrupted reference's (the docs promise a bitwise resume for both front-ends).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from bench.notice.common import (VALIDATION_OVER_BUDGET, reference, result, rows, same_arrays, send_notice,
                                 wait_for)
from spot_training.agent.process_group import ProcessGroup
from spot_training.training.store import CheckpointStore

REPO = Path(__file__).resolve().parents[2]
EPOCHS, SPE = 3, 10


def _command(mode: str, root: Path, *extra: str, epochs: int = EPOCHS) -> list[str]:
    return [sys.executable, "-m", "bench.notice.tf_job", mode, "--checkpoint-dir", str(root / "ckpt"),
            "--log", str(root / "steps.csv"), "--epochs", str(epochs), *extra]


def prepare(tmp: Path, mode: str) -> dict:
    """Where the uninterrupted reference run's variables go (``tmp/reference.npz``); the first trial
    that resumes runs it.

    Args:
        tmp: the drill's temporary directory.
        mode: ``"keras"`` (``model.fit``) or ``"tf"`` (the custom loop).

    Returns:
        ``{"reference": <path>, "mode": mode}``.
    """
    return {"reference": tmp / "reference.npz", "mode": mode}


def _reference_run(mode: str, ref: Path) -> bool:
    with open(ref.with_suffix(".log"), "wb") as log:
        return subprocess.run(_command(mode, ref.with_suffix(""), "--final", str(ref)), cwd=REPO, stdout=log,
                              stderr=subprocess.STDOUT, timeout=600).returncode == 0


def trial(root: Path, ctx: dict, *, phase: str, rng: random.Random) -> dict:
    """One run of ``tf_job.py`` (in ``ctx["mode"]``) with one notice inside ``phase``, then its resume to the end.

    Implements :meth:`bench.notice.common.FrontEnd.trial`.
    """
    mode = ctx["mode"]
    budget = ctx["budget_s"]
    validation_s = budget * VALIDATION_OVER_BUDGET
    extra = ["--save-every-steps", "1" if phase == "write" else "7"]
    if phase.startswith("pydataset/w"):
        extra += ["--workers", phase.split("/w")[1]]
    if phase == "validation":
        extra += ["--validation-s", f"{validation_s:.3f}"]
    command = _command(mode, root, *extra)
    if phase == "startup":  # a resume: one epoch leaves a checkpoint to restore
        subprocess.run(_command(mode, root, *extra, epochs=1), cwd=REPO, check=True, capture_output=True, timeout=600)
        (root / "ckpt" / "COMPLETED").unlink(missing_ok=True)
    trainer_log = root / "trainer.log"
    group = ProcessGroup.start(command, cwd=REPO, env=dict(os.environ), log_path=trainer_log)

    def printed(marker: str) -> bool:
        return trainer_log.exists() and marker in trainer_log.read_text(errors="replace")

    if phase == "startup":
        wait_for(lambda: False, group, timeout_s=rng.uniform(1.0, 3.0))
    elif phase == "first-trace":
        wait_for(lambda: printed("PHASE fit"), group)
        wait_for(lambda: False, group, timeout_s=rng.uniform(0.0, 1.0))
    elif phase == "validation":
        wait_for(lambda: printed("PHASE validation"), group)
        wait_for(lambda: False, group, timeout_s=rng.uniform(0.0, validation_s - budget))
    else:
        target = rng.randint(3, EPOCHS * SPE - 5)
        wait_for(lambda: rows(root / "steps.csv") >= target, group)
    sent = send_notice(group, budget)
    exit_status = group.poll()
    latest = CheckpointStore(root / "ckpt", framework="tensorflow").latest()
    ran = rows(root / "steps.csv")
    text = trainer_log.read_text(errors="replace")
    bitwise = None
    if ctx.get("resume", True):  # to the end (without the validation pass: it changes no variable)
        resumed = subprocess.run(_command(mode, root, "--final", str(root / "final.npz")), cwd=REPO,
                                 capture_output=True, text=True, timeout=600)
        bitwise = resumed.returncode == 0 and same_arrays(
            root / "final.npz", reference(ctx["reference"], lambda ref: _reference_run(mode, ref)))
    out = result(phase, exit_status=exit_status, ran=ran, latest=latest, sent=sent, log_text=text, bitwise=bitwise,
                 notice_to_exit_s=group.notice_to_exit_s)
    out["worker_killed"] = out["worker_killed"] or "Traceback" in text
    return out
