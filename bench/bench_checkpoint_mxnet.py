"""Checkpoint cost and lost work for MXNet Gluon, every figure measured in this one run.

    .venv/bin/python bench/bench_checkpoint_mxnet.py [--pairs 40] [--kills 2]

Model: an MLP on the 8x8 digits (64 -> 2048 -> 2048 -> 512 -> 10, about 5.4 M parameters) trained
with Adam, batch 64, one OpenMP thread (as the examples run), checkpoint every 50 steps with
:class:`spot_training.training.mxnet_adapter.GluonCheckpointer`.

1. Overhead, by paired windows, as in bench/bench_checkpoint.py (1.) and with bench/paired.py: one
   run per mode (synchronous, background) trains in windows of 10 steps that alternate without
   and with one save (at the window's first step; a background window ends by waiting for its
   write); each saving window is compared with the window before it. Overhead % = the mean extra
   wall time of one save over the time of 50 steps (a save every 50 steps), with its 95 %
   confidence interval and the median; ``training_thread_blocked_pct`` is the time inside the
   save calls over the same 50 steps; ``cpu_overhead_pct`` is the extra CPU time of all threads
   per save, paired the same way (what a node without a spare core pays).
2. Save time (sync: full write; background: time the training thread is blocked for the host copy;
   write: time of one full store write of that copy), restore time (fresh process state: new model,
   ``GluonCheckpointer.restore``), checkpoint size on disk.
3. Lost steps: a worker process (this file with ``--worker``) trains and saves every 50 steps in
   the background; it gets SIGTERM at a random step (lost = steps it ran - steps in its last
   checkpoint; goal 0) and, in ``--kills`` other runs, SIGKILL (lost = steps run - steps committed;
   goal <= the save interval). The article's way (a checkpoint per epoch, a notice handler that
   sleeps) loses the steps since the last epoch boundary: computed for the same kill steps with
   this dataset's epoch of 22 steps, and for a larger epoch of 1,000 steps for scale.

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

from paired import (BATCH, HIDDEN, SAVE_EVERY, SEED, WARMUP_PAIRS, WINDOW,  # noqa: E402
                    dir_bytes, lost_steps_and_report, paired_modes, parse_worker_bench_args,  # noqa: E402
                    digits_scratch, quiet_notices, time_restores, worker_steps)  # (bench/paired.py)

from spot_training.training.datasets import batch_indices, load_digits  # noqa: E402


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


def worker(args) -> int:
    """Train until signalled; print each completed step (the parent counts lost steps)."""
    import mxnet as mx
    from mxnet import autograd, gluon

    from spot_training.training.mxnet_adapter import GluonCheckpointer
    from spot_training.training.notice import NoticeHandler

    x, y = load_digits(args.data_dir, "train")
    x = x.reshape(len(x), -1)
    net, trainer = build(mx, gluon)
    step = make_step(mx, autograd, gluon, net, trainer, x, y)
    ckpt = GluonCheckpointer(net, trainer, checkpoint_dir=args.checkpoint_dir, every_steps=SAVE_EVERY,
                             background=True, notices=NoticeHandler(request_file=None))
    return worker_steps(ckpt.steps(10**9), step)


def main() -> int:
    """Run the MXNet checkpoint benchmark (module docstring); the last line printed is JSON.

    Returns:
        0 (the ``--worker`` mode returns its own status).
    """
    args = parse_worker_bench_args(__doc__.split("\n\n")[0], WINDOW)
    if args.worker:
        return worker(args)

    import mxnet as mx
    from mxnet import autograd, gluon

    from spot_training.training.mxnet_adapter import PARAMS_FILE, GluonCheckpointer, capture_state
    from spot_training.training.store import CheckpointStore

    with digits_scratch("bench-ckpt-mxnet-") as (scratch, data_dir, x, y):
        net, trainer = build(mx, gluon)
        n_params = sum(int(np.prod(p.shape)) for p in net.collect_params().values())
        step = make_step(mx, autograd, gluon, net, trainer, x, y)
        for i in range(20):  # warm-up: graph caching, allocator, Adam state creation
            step(i)

        # Paired windows (bench/bench_checkpoint.py, 1.; bench/paired.py): one run per mode whose
        # WINDOW-step windows alternate without and with one save, at the window's first step.
        def checkpointer(mode):
            return GluonCheckpointer(net, trainer, checkpoint_dir=scratch / mode, every_steps=SAVE_EVERY,
                                     background=(mode == "background"), notices=quiet_notices())

        run = paired_modes(checkpointer, step, start=20, pairs=args.pairs, warmup_pairs=WARMUP_PAIRS, window=WINDOW,
                           save_every=SAVE_EVERY)
        metadata = run["checkpointers"]["sync"].manifest_metadata()

        # One full background write of a host copy (what the writer thread does per save).
        state = capture_state(net, trainer)
        write_times = []
        store = CheckpointStore(scratch / "writes", framework="mxnet")
        for i in range(3):
            started = time.perf_counter()
            store.save(state.write, step=i + 1, epoch=0, metadata=metadata)
            write_times.append(time.perf_counter() - started)
        latest = store.latest()
        size_mb = dir_bytes(latest.path) / 1e6
        params_mb = (latest.path / PARAMS_FILE).stat().st_size / 1e6

        def open_checkpointer():
            fresh_net, fresh_trainer = build(mx, gluon)
            ck = GluonCheckpointer(fresh_net, fresh_trainer, checkpoint_dir=scratch / "writes", notices=quiet_notices())
            return ck.restore, ck.close

        restore_times = time_restores(open_checkpointer)

        lost_steps_and_report(
            script=__file__, data_dir=data_dir, scratch=scratch, args=args, n_examples=len(x), framework="mxnet",
            version_key="mxnet_version", version=mx.__version__, title="MXNet Gluon checkpoint benchmark",
            size_note="parameters {params_mb:.1f} MB + trainer states",
            n_params=n_params, run=run, write_times=write_times, restore_times=restore_times, size_mb=size_mb,
            params_mb=params_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
