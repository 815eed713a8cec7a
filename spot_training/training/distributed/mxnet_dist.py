"""MXNet ``dist_sync`` Gluon trainer for a parameter-server cluster generation (the worker command).

    DMLC_ROLE=worker DMLC_PS_ROOT_URI=... python -m spot_training.training.distributed.mxnet_dist --steps 300

Started by the node agent with the ``DMLC_*`` variables of the plan (spot_training/agent/launch.py). An MLP on
the 8x8 digits (no BatchNorm: each worker would keep its own running statistics), SGD with momentum,
``gluon.Trainer(..., kvstore=dist_sync, update_on_kvstore=False)``: gradients are summed on the
servers and every worker applies the same update locally, so the optimizer states live in each worker
and rank 0 can save them (with ``update_on_kvstore=True`` ``Trainer.save_states`` refuses in
distributed mode). Rank 0 checkpoints through :class:`spot_training.training.mxnet_adapter.GluonCheckpointer`
(every ``--save-every-steps``; synchronous, the model is tiny); every rank restores the newest
checkpoint at start, so a new generation continues from it with any number of workers. The restore
also broadcasts rank 0's parameters and waits for them before the first step
(:func:`spot_training.training.mxnet_adapter.sync_distributed_parameters`: Gluon's own broadcast inside the first
step races the first gradient push in MXNet 1.9.1).

Stopping together. A ``dist_sync`` step needs every worker; a worker that stops alone leaves the
others hanging in the kvstore. So before each step the workers sum a stop flag through the kvstore
(one extra 4-byte push/pull on key ``STOP_KEY``): if any worker got SIGTERM, all of them stop at the
same step, rank 0 writes the checkpoint, and every worker exits 0. After the last step rank 0
evaluates on the held-out digits, writes ``<log_dir>/result.json`` (``step``, ``test_accuracy``,
``generation``, ``num_workers``), then the final checkpoint and ``COMPLETED``. Workers then
leave with ``os._exit`` (see :func:`run`): ps-lite's exit barrier can hang.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np

from spot_training.training.distributed.common import (StepLog, flat_digits, generation, global_batch, global_batch_size, pace, parse_args,
                                         run_and_exit, worker_shard, write_result)
from spot_training.training.distributed.lr import scaled_learning_rate

#: kvstore key of the stop flag; far above the Trainer's parameter indices (0..n-1).
STOP_KEY = 1_000_003


def build_mlp(hidden: int, classes: int = 10):
    """64 -> ``hidden`` (ReLU) -> ``hidden`` (ReLU) -> ``classes`` Gluon MLP with known input sizes.

    Args:
        hidden: units in each of the two hidden layers.
        classes: output logits (default 10, the digits).

    Returns:
        an uninitialised ``mxnet.gluon.nn.HybridSequential`` taking inputs of shape ``(batch, 64)``.
    """
    from mxnet.gluon import nn

    net = nn.HybridSequential()
    net.add(nn.Dense(hidden, activation="relu", in_units=64), nn.Dense(hidden, activation="relu", in_units=hidden),
            nn.Dense(classes, in_units=hidden))
    return net


def main(argv=None) -> int:
    """Train on the digits with a ``dist_sync`` kvstore (``local`` alone), resuming from the newest checkpoint.

    Args:
        argv: the arguments (:func:`~spot_training.training.distributed.common.parse_args`); default ``sys.argv[1:]``.

    Returns:
        the exit status (module docstring): 0 after the last step or an agreed stop's checkpoint.
    """
    args = parse_args(argv, description="MXNet dist_sync trainer of a spot-training cluster")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before MXNet loads OpenMP; fastest for tiny models
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import mxnet as mx
    from mxnet import autograd, gluon

    from spot_training.training.mxnet_adapter import GluonCheckpointer

    log = logging.getLogger("training.mxnet_dist")
    kv = mx.kv.create("dist_sync" if os.environ.get("DMLC_ROLE") == "worker" else "local")
    rank, num_workers = kv.rank, kv.num_workers
    x_train, y_train, x_test, y_test = flat_digits(args.data_dir)
    n = len(x_train)
    batch = global_batch_size(args, num_workers)

    mx.random.seed(args.seed)
    net = build_mlp(args.hidden)
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": args.learning_rate, "momentum": 0.9},
                            kvstore=kv, update_on_kvstore=False)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    ckpt = GluonCheckpointer(net, trainer, checkpoint_dir=args.checkpoint_dir, every_steps=args.save_every_steps or None,
                             background=False,
                             # --per-worker-batch: the global batch, so the epoch length, changes with the
                             # workers; no epoch is recorded then (the data position is the step either way).
                             steps_per_epoch=None if args.per_worker_batch else max(1, n // batch))
    ckpt.install()
    start = ckpt.restore()
    kv.init(STOP_KEY, mx.nd.zeros((1,)))
    flag, total = mx.nd.zeros((1,)), mx.nd.zeros((1,))
    log.info("worker rank %d of %d, generation %d, starting at step %d of %d", rank, num_workers, generation(),
             start, args.steps)
    steps_log = StepLog(args.log_dir, steps_total=args.steps)
    stopped = False
    try:
        for step in range(start, args.steps):
            began = time.perf_counter()
            flag[:] = 1.0 if ckpt.notices.stop_requested else 0.0
            kv.push(STOP_KEY, flag)
            kv.pull(STOP_KEY, out=total)
            if total.asscalar() > 0:
                stopped = True
                break
            lr = (scaled_learning_rate(args.learning_rate, num_workers=num_workers, step=step,
                                       warmup_steps=args.warmup_steps) if args.scale_lr else args.learning_rate)
            trainer.set_learning_rate(lr)
            idx = worker_shard(global_batch(step, batch_size=batch, n=n, seed=args.seed), rank=rank,
                               num_workers=num_workers)
            data, label = mx.nd.array(x_train[idx]), mx.nd.array(y_train[idx])
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(batch)  # gradients summed over workers / global batch = mean over the global batch
            ckpt.step = step + 1
            steps_log.write(step=ckpt.step, rank=rank, num_workers=num_workers, loss=float(loss.mean().asscalar()),
                            learning_rate=lr)
            if rank == 0 and (ckpt.notices.consume_checkpoint_request() or ckpt.schedule.due(ckpt.step)):
                ckpt.save()
            pace(began, args.min_step_seconds)
        if stopped:
            if rank == 0:
                ckpt.save(wait=True)
            log.info("stop agreed by the workers: rank %d exits at step %d (checkpoint by rank 0)", rank, ckpt.step)
            return 0
        if rank == 0:
            # result.json before COMPLETED, whose appearance makes the coordinator tear the generation down.
            accuracy = float((net(mx.nd.array(x_test)).argmax(axis=1).asnumpy() == y_test).mean())
            write_result(args.log_dir, {"step": ckpt.step, "test_accuracy": accuracy, "generation": generation(),
                                        "num_workers": num_workers, "framework": "mxnet"})
            ckpt.finish()
            log.info("done at step %d: test accuracy %.4f", ckpt.step, accuracy)
        return 0
    finally:
        steps_log.close()
        ckpt.close()


def run() -> None:
    """``main()``, then exit. A distributed worker leaves with ``os._exit``: at interpreter exit MXNet's
    kvstore destructor waits in a ps-lite barrier for every worker and the servers, which was seen to
    hang after an agreed stop (3 workers, 60 s); rank 0's checkpoint is already durable (written,
    fsynced, committed) and the agents stop the scheduler and servers in the teardown anyway."""
    run_and_exit(main, hard_exit=os.environ.get("DMLC_ROLE") == "worker")


if __name__ == "__main__":
    run()
