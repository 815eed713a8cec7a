"""Checkpoint cost and lost work for MXNet Gluon, every figure measured in this one run.

    .venv/bin/python bench/bench_checkpoint_mxnet.py [--pairs 40] [--kills 2]

Model: an MLP on the 8x8 digits (64 -> 2048 -> 2048 -> 512 -> 10, about 5.4 M parameters) trained
with Adam, batch 64, one OpenMP thread (as the examples run), checkpoint every 50 steps with
:class:`spot_training.training.mxnet_adapter.GluonCheckpointer`.

Measured as bench/paired.py's ``checkpoint_cost_bench`` describes: overhead by paired windows,
save, write and restore times, checkpoint size, steps lost to SIGTERM and SIGKILL.

Prints a table, then a LAST LINE of JSON that bench/bench_checkpoint.py merges.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from paired import (BATCH, HIDDEN, SAVE_EVERY, SEED, WINDOW, checkpoint_cost_bench,  # noqa: E402
                    checkpoint_worker, parse_worker_bench_args)  # (bench/paired.py)

from spot_training.training.datasets import batch_indices  # noqa: E402


def build(mx, gluon):
    """The benchmark's MLP (64 -> :data:`HIDDEN` -> 10, Xavier, hybridized) and its Adam trainer.

    Args:
        mx: the ``mxnet`` module (imported by the caller).
        gluon: the ``mxnet.gluon`` module.

    Returns:
        ``(net, trainer)`` (``update_on_kvstore=False``, learning rate 1e-4).
    """
    from mxnet.gluon import nn

    mx.random.seed(SEED)
    net = nn.HybridSequential()
    with net.name_scope():
        units_in = 64
        for units in HIDDEN:
            net.add(nn.Dense(units, activation="relu", in_units=units_in))
            units_in = units
        net.add(nn.Dense(10, in_units=units_in))
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-4}, update_on_kvstore=False)
    return net, trainer


def make_step(mx, autograd, gluon, net, trainer, x, y):
    """The benchmark's training step: forward, backward and update on batch ``index`` (:func:`batch_indices`).

    Args:
        mx: the ``mxnet`` module.
        autograd: ``mxnet.autograd``.
        gluon: ``mxnet.gluon``.
        net: the model.
        trainer: its trainer.
        x: features, float32 of shape ``(N, 64)``.
        y: labels, shape ``(N,)``.

    Returns:
        ``step(index)``, which waits for the step's loss.
    """
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    n = len(x)

    def step(index: int) -> None:
        idx = batch_indices(index, batch_size=BATCH, n=n, seed=SEED)
        data, label = mx.nd.array(x[idx]), mx.nd.array(y[idx])
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(BATCH)
        loss.wait_to_read()

    return step


def main() -> int:
    """Run the MXNet checkpoint benchmark (module docstring) and return 0 (``--worker``: the worker's status);
    the last line printed is JSON."""
    args = parse_worker_bench_args(__doc__.split("\n\n")[0], WINDOW)

    import mxnet as mx
    from mxnet import autograd, gluon

    from spot_training.training.mxnet_adapter import PARAMS_FILE, GluonCheckpointer, capture_state

    def checkpointer(net, trainer, directory, background, notices):
        return GluonCheckpointer(net, trainer, checkpoint_dir=directory, every_steps=SAVE_EVERY, background=background,
                                 notices=notices)

    def timed_write(net, trainer, store, step, metadata):
        state = capture_state(net, trainer)
        started = time.perf_counter()
        store.save(state.write, step=step, epoch=0, metadata=metadata)
        return time.perf_counter() - started

    parts = dict(build=lambda: build(mx, gluon), checkpointer=checkpointer,
                 make_step=lambda net, trainer, x, y: make_step(mx, autograd, gluon, net, trainer, x, y))
    if args.worker:
        return checkpoint_worker(args, **parts)
    checkpoint_cost_bench(
        script=__file__, args=args, prefix="bench-ckpt-mxnet-", framework="mxnet", **parts,
        count_params=lambda net: sum(int(np.prod(p.shape)) for p in net.collect_params().values()),
        timed_write=timed_write, params_file=PARAMS_FILE, version_key="mxnet_version",
        version=mx.__version__, title="MXNet Gluon checkpoint benchmark",
        size_note="parameters {params_mb:.1f} MB + trainer states")
    return 0


if __name__ == "__main__":
    sys.exit(main())
