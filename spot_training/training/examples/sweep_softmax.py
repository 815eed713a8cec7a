"""A small resumable trainer for sweeps: softmax regression on scikit-learn's bundled digits, numpy only.

Every step's batch is a function of ``(seed, step)`` (spot_training.training.datasets.batch_indices)
and the whole state is ``W`` and ``b``, so a run interrupted and resumed from a checkpoint ends
bitwise equal to an uninterrupted one. It knows nothing of sweeps: its hyperparameters come as
options (``--lr 0.5 --l2 1e-4``), as on a fleet node or a cluster.

    python -m spot_training.training.examples.sweep_softmax --lr 0.5 --steps 400 --save-final-weights w.npz

Writes ``training_log.csv`` (step, epoch, loss, accuracy, wall_time) to ``$SPOT_TRAINING_LOG_DIR``
and checkpoints to ``$SPOT_TRAINING_CHECKPOINT_DIR`` (spot_training.training.core.CheckpointDriver).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from spot_training.training.core import (
    CheckpointDriver,
    StateAdapter,
    add_checkpoint_arguments,
    cadence_flag,
    check_checkpoint_arguments,
    run_script,
)
from spot_training.training.datasets import batch_indices, default_log_dir, steps_per_epoch
from spot_training.training.store import ShapeMismatchError, write_file

#: The first 1,437 of scikit-learn's 1,797 digits train, the rest test (the drills' 80/20 split).
TRAIN_EXAMPLES = 1437


class SoftmaxAdapter(StateAdapter):
    """``W`` (64, 10) and ``b`` (10,) float64, written raw.

    Args:
        w: the weights, float64 of shape ``(64, 10)``, updated in place on restore.
        b: the biases, float64 of shape ``(10,)``, updated in place on restore.
    """

    framework = "numpy"
    adapter = "sweep-softmax"

    def __init__(self, w: np.ndarray, b: np.ndarray) -> None:
        self.w, self.b = w, b

    def framework_version(self) -> str:
        """``numpy <version>`` (see :meth:`StateAdapter.framework_version`)."""
        return f"numpy {np.__version__}"

    def snapshot(self, directory: Path):
        """Copy ``W`` and ``b``; the returned function writes ``w.raw`` and ``b.raw`` into ``directory``.

        Args:
            directory: the store's empty temporary directory.

        Returns:
            the writer, which returns the two files' manifest entries.
        """
        w, b = self.w.copy(), self.b.copy()
        return lambda: {"w.raw": write_file(directory / "w.raw", [w]), "b.raw": write_file(directory / "b.raw", [b])}

    def load(self, ckpt) -> None:
        """Read ``w.raw`` and ``b.raw`` into ``W`` and ``b``.

        Args:
            ckpt: the checkpoint to restore.

        Raises:
            ShapeMismatchError: the files hold another number of values than the model.
        """
        w = np.fromfile(ckpt.path / "w.raw", dtype=np.float64)
        b = np.fromfile(ckpt.path / "b.raw", dtype=np.float64)
        if w.size != self.w.size or b.size != self.b.size:
            raise ShapeMismatchError(f"checkpoint {str(ckpt.path)!r}: W has {w.size} values, the model {self.w.size}")
        self.w[:] = w.reshape(self.w.shape)
        self.b[:] = b


def train(argv: list[str] | None = None) -> int:
    """Train (see the module docstring); returns 0.

    Raises:
        SystemExit: 2 for bad options.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=0.5, help="learning rate (default 0.5)")
    parser.add_argument("--l2", type=float, default=0.0, help="L2 penalty on W (default 0)")
    parser.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="sleep after each step (drills: a slower trainer)")
    parser.add_argument("--save-final-weights", default=None, help="write W and b to this .npz at the end")
    add_checkpoint_arguments(parser)
    args = parser.parse_args(argv)
    check_checkpoint_arguments(parser, args)
    if not (args.lr > 0 and args.l2 >= 0 and args.steps >= 1):
        parser.error(f"--lr must be > 0, --l2 >= 0 and --steps >= 1, got {args.lr}, {args.l2}, {args.steps}")
    from sklearn.datasets import load_digits

    x_all, y_all = load_digits(return_X_y=True)
    x_all = x_all / 16.0
    x, y, x_test, y_test = x_all[:TRAIN_EXAMPLES], y_all[:TRAIN_EXAMPLES], x_all[TRAIN_EXAMPLES:], y_all[TRAIN_EXAMPLES:]
    w, b = np.zeros((64, 10)), np.zeros(10)
    spe = steps_per_epoch(len(x), args.batch_size)
    driver = CheckpointDriver(SoftmaxAdapter(w, b), checkpoint_dir=args.checkpoint_dir, every_steps=cadence_flag(args.save_every_steps),
                              every_seconds=cadence_flag(args.save_every_seconds), keep=args.keep, steps_per_epoch=spe,
                              background=False)
    log_dir = args.log_dir or default_log_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "training_log.csv"
    new = not log_path.exists()
    with open(log_path, "a", buffering=1) as log:
        if new:
            log.write("step,epoch,loss,accuracy,wall_time\n")
        for step in driver.steps(args.steps):
            idx = batch_indices(step, batch_size=args.batch_size, n=len(x), seed=args.seed)
            xb, yb = x[idx], y[idx]
            logits = xb @ w + b
            logits -= logits.max(axis=1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=1, keepdims=True)
            loss = float(-np.log(p[np.arange(len(yb)), yb]).mean())
            accuracy = float((p.argmax(axis=1) == yb).mean())
            p[np.arange(len(yb)), yb] -= 1.0
            w -= args.lr * (xb.T @ p / len(yb) + args.l2 * w)
            b -= args.lr * p.mean(axis=0)
            log.write(f"{step + 1},{step // spe},{loss:.6f},{accuracy:.4f},{time.time():.3f}\n")
            if args.step_delay_s:
                time.sleep(args.step_delay_s)
    test_accuracy = float(((x_test @ w + b).argmax(axis=1) == y_test).mean())
    print(f"done: {args.steps} steps, test accuracy {test_accuracy:.4f}", flush=True)
    if args.save_final_weights:
        path = Path(os.path.expanduser(args.save_final_weights))
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, w=w, b=b)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(train))
