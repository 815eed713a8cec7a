"""Phase drill, PyTorch: ``spot_training/training/examples/torch_resnet.py`` on the digits.

Phases: ``startup`` (1-3 s after start, while torch is imported and the newest checkpoint restored:
the directory already holds one, a resume); ``step/wN`` (after 3-15 steps of a run whose
``DataLoader`` has N persistent workers); ``write`` (a checkpoint after every step, so a background
write is in flight at nearly every notice). With the runner's ``resume`` (the full form), each
``step/wN`` and ``write`` trial is then resumed to the end and its final model and optimizer state
compared bitwise with one uninterrupted run's (docs/training-pytorch.md promises exact resume: batches
come from the step index, not from the loader's workers). A ``startup`` trial resumes a 5-step run's
checkpoint into a 400-step run (another learning-rate schedule), so it has no reference (bitwise: None).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

from bench.notice.common import reference, result, rows, same_arrays, send_notice, wait_for
from spot_training.agent.process_group import ProcessGroup
from spot_training.training.examples.prepare_data import prepare_digits
from spot_training.training.store import CheckpointStore

PYTHON = "torch"
PHASES = ("startup", "step/w0", "step/w2", "step/w4", "write")
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "spot_training" / "training" / "examples" / "torch_resnet.py"


def prepare(tmp: Path) -> dict:
    """The digits under ``tmp/data``; where the uninterrupted reference run's state goes (the first trial
    that resumes runs it).

    Args:
        tmp: the drill's temporary directory.

    Returns:
        ``{"data_dir": <path>, "reference": <path of its .npz>}``.
    """
    prepare_digits(tmp / "data")
    return {"data_dir": tmp / "data", "reference": tmp / "reference" / "final.npz"}


def _args(ctx: dict, root: Path, *, workers: int, save_every: int, final: Path | None = None) -> list[str]:
    args = [sys.executable, str(EXAMPLE), "--steps", "400", "--batch-size", "32", "--device", "cpu",
            "--data-dir", str(ctx["data_dir"]), "--checkpoint-dir", str(root / "ckpt"), "--log-dir", str(root / "logs"),
            "--num-workers", str(workers), "--step-delay", "0.02", "--save-every-steps", str(save_every)]
    return args + (["--save-final-weights", str(final)] if final is not None else [])


def _run_to_end(args: list[str], log_path: Path) -> int:
    with open(log_path, "ab") as log:
        return subprocess.run(args, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                              stderr=subprocess.STDOUT, timeout=900).returncode


def _reference_run(ctx: dict, ref: Path) -> bool:
    return _run_to_end(_args(ctx, ref.parent, workers=0, save_every=25, final=ref), ref.parent / "run.log") == 0


def trial(root: Path, ctx: dict, *, phase: str, rng: random.Random) -> dict:
    """One run of the example and one notice inside ``phase``.

    Implements :meth:`bench.notice.common.FrontEnd.trial`.
    """
    workers = int(phase.split("/w")[1]) if phase.startswith("step/w") else 0
    ckpt_dir, log_dir = root / "ckpt", root / "logs"
    args = _args(ctx, root, workers=workers, save_every=1 if phase == "write" else 25)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if phase == "startup":  # a resume: one short run leaves a checkpoint to restore
        first = ProcessGroup.start([*args[:2], "--steps", "5", *args[4:]], cwd=REPO, env=env,
                                   log_path=root / "first.log")
        first.proc.wait(timeout=300)
        (ckpt_dir / "COMPLETED").unlink(missing_ok=True)
    group = ProcessGroup.start(args, cwd=REPO, env=env, log_path=root / "trainer.log")
    log = log_dir / "training_log.csv"
    if phase == "startup":
        time.sleep(rng.uniform(1.0, 3.0))
    else:
        target = rng.randint(3, 15)
        wait_for(lambda: rows(log) >= target, group)
    sent = send_notice(group, ctx["budget_s"])
    latest = CheckpointStore(ckpt_dir, framework="pytorch").latest()
    figures = result(phase, exit_status=group.poll(), ran=rows(log), latest=latest, sent=sent,
                     log_text=(root / "trainer.log").read_text(errors="replace"),
                     notice_to_exit_s=group.notice_to_exit_s)
    if ctx.get("resume") and phase != "startup":
        final = root / "final.npz"
        resumed = _run_to_end([*args, "--save-final-weights", str(final)], root / "resume.log")
        figures["bitwise"] = resumed == 0 and same_arrays(
            final, reference(ctx["reference"], lambda ref: _reference_run(ctx, ref)))
    return figures
