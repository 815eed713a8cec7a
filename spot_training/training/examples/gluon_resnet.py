"""The article's training job, MXNet Gluon twin: a small ResNet-style CNN on the 8x8 digits.

    python spot_training/training/examples/gluon_resnet.py [--steps N | --epochs E] [--batch-size 32]
        [--save-every-steps 50] [--save-every-seconds S] [--seed 0] [--sync]

Reads ``<SPOT_TRAINING_DATA_DIR>/digits/{train,test}.npz`` (write it with
``python -m spot_training.training.examples.prepare_data``), checkpoints to ``SPOT_TRAINING_CHECKPOINT_DIR``,
appends one row per step to ``<SPOT_TRAINING_LOG_DIR>/training_log.csv``
(``step,epoch,loss,accuracy,wall_time``: step = completed optimizer steps after that step, epoch
0-based, loss and accuracy of that step's batch, wall_time in seconds since the epoch) and writes
``progress.json`` (the total steps; :mod:`spot_training.training.training_log`). SIGTERM:
finish the step, save, exit 0. SIGUSR1 or the request file: extra checkpoint. Run it again and it
resumes at the exact step; after the last step it writes the final checkpoint and ``COMPLETED``.

Determinism: with the same ``--seed`` an interrupted and resumed run ends with parameters bitwise
equal to an uninterrupted one. The parameters are initialised from ``mx.random.seed(seed)``, the
batches come from the step number (spot_training/training/datasets.py), the model has no dropout, and every
piece of optimizer state is in the checkpoint. MXNet's CPU kernels (oneDNN) split work across OpenMP
threads and can sum in a thread-count-dependent order, so the run pins ``OMP_NUM_THREADS=1`` (the
default here, overridable by ``--threads``, set before MXNet is imported): one thread fixes the
summation order, and on small nodes it is also the fastest setting for an 8x8 model. The engine
stays the default threaded one (MXNet orders operations by data dependency, which does not change
results); ``MXNET_ENGINE_TYPE=NaiveEngine`` is not needed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `spot_training.training` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

# Before the slow imports (MXNet: seconds): a SIGTERM meanwhile is remembered and the run exits 0 at
# its start instead of dying by the signal (docs/training.md, "A notice in any phase").
import spot_training.training.early_notice  # noqa: E402,F401

import numpy as np  # noqa: E402

from spot_training.training.core import (add_checkpoint_arguments, add_length_arguments, cadence_flag,
                                         parse_trainer_arguments, run_script)
from spot_training.training.datasets import batch_indices, default_data_dir, load_digits, steps_per_epoch
from spot_training.training.training_log import TrainingLog


def build_net(*, channels: int = 16, blocks: int = 2, classes: int = 10, width: int | None = None):
    """A ResNet-style CNN for 1x8x8 inputs (NCHW): conv-BN-ReLU stem, ``blocks`` residual blocks of
    ``channels`` (two 3x3 conv-BN with identity shortcut), global average pooling, a dense layer of
    ``width`` units if given, and a ``classes``-way dense output. Defaults: about 10 K parameters.

    Args:
        channels: convolution channels of the stem and every block (default 16).
        blocks: residual blocks (default 2).
        classes: output logits (default 10).
        width: units of a hidden dense layer before the output (None or 0: none).

    Returns:
        an uninitialised ``gluon.nn.HybridSequential`` taking ``(N, 1, 8, 8)`` inputs.
    """
    from mxnet.gluon import nn

    class ResidualBlock(nn.HybridBlock):
        def __init__(self, ch, **kwargs):
            super().__init__(**kwargs)
            self.body = nn.HybridSequential()
            self.body.add(nn.Conv2D(ch, 3, padding=1, use_bias=False, in_channels=ch),
                          nn.BatchNorm(in_channels=ch), nn.Activation("relu"),
                          nn.Conv2D(ch, 3, padding=1, use_bias=False, in_channels=ch),
                          nn.BatchNorm(in_channels=ch))

        def hybrid_forward(self, F, x):
            return F.relu(self.body(x) + x)

    net = nn.HybridSequential()
    net.add(nn.Conv2D(channels, 3, padding=1, use_bias=False, in_channels=1),
            nn.BatchNorm(in_channels=channels), nn.Activation("relu"))
    for _ in range(blocks):
        net.add(ResidualBlock(channels))
    net.add(nn.GlobalAvgPool2D(), nn.Flatten())
    if width:
        net.add(nn.Dense(width, activation="relu", in_units=channels))
        net.add(nn.Dense(classes, in_units=width))
    else:
        net.add(nn.Dense(classes, in_units=channels))
    return net


def parse_args(argv=None) -> argparse.Namespace:
    """The example's command line from ``argv`` (default ``sys.argv[1:]``; ``--help`` lists the options),
    checked: a bad value exits 2 naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_length_arguments(parser)  # --steps or --epochs 5, --batch-size 32
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    add_checkpoint_arguments(parser)  # cadence (no default of its own), --keep, --sync, the directories
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--width", type=int, default=0, help="hidden dense units before the output (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for MXNet (default 1, see above)")
    parser.add_argument("--hybridize", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--save-final-params", type=Path, default=None,
                        help="also write the final parameters to this .npz (for comparisons)")
    return parse_trainer_arguments(parser, argv, "threads")


def train(argv=None) -> int:
    """Train the ResNet on the digits (module docstring): parse ``argv`` (:func:`parse_args`), resume from
    the newest checkpoint, return 0 after the last step. A stop notice: ``SystemExit(0)`` after its checkpoint;
    a checkpoint no restart can fix: ``CheckpointError`` (``run_script`` below turns it into exit 74 or 78)."""
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before MXNet loads its OpenMP runtime
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import mxnet as mx
    from mxnet import autograd, gluon

    from spot_training.training.mxnet_adapter import GluonCheckpointer

    data_dir = args.data_dir or default_data_dir()
    x_train, y_train = load_digits(data_dir, "train", layout="NCHW")
    x_test, y_test = load_digits(data_dir, "test", layout="NCHW")
    n, bs = len(x_train), args.batch_size
    spe = steps_per_epoch(n, bs)
    total_steps = args.steps if args.steps is not None else args.epochs * spe

    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    ctx = mx.cpu()
    net = build_net(channels=args.channels, blocks=args.blocks, width=args.width or None)
    net.initialize(mx.init.Xavier(), ctx=ctx)
    if args.hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": args.learning_rate},
                            update_on_kvstore=False)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    ckpt = GluonCheckpointer(
        net, trainer, checkpoint_dir=args.checkpoint_dir, every_steps=cadence_flag(args.save_every_steps),
        every_seconds=cadence_flag(args.save_every_seconds), background=not args.sync, keep=args.keep,
        steps_per_epoch=spe,
    )
    log = TrainingLog(args.log_dir, steps_total=total_steps)  # training_log.csv and progress.json
    try:
        for step in ckpt.steps(total_steps):
            idx = batch_indices(step, batch_size=bs, n=n, seed=args.seed)
            data, label = mx.nd.array(x_train[idx], ctx=ctx), mx.nd.array(y_train[idx], ctx=ctx)
            with autograd.record():
                output = net(data)
                loss = loss_fn(output, label)
            loss.backward()
            trainer.step(bs)
            accuracy = float((output.argmax(axis=1).asnumpy() == y_train[idx]).mean())
            log.write(step + 1, step // spe, float(loss.mean().asscalar()), accuracy)
    finally:
        log.close()

    test_pred = net(mx.nd.array(x_test, ctx=ctx)).argmax(axis=1).asnumpy()
    logging.info("done: %d steps, test accuracy %.4f", total_steps, float((test_pred == y_test).mean()))
    if args.save_final_params:
        final = {name: p.data().asnumpy() for name, p in net._collect_params_with_prefix().items()}
        np.savez(args.save_final_params, **final)
    return 0


if __name__ == "__main__":
    # run_script: a checkpoint error that no restart can fix exits 74 or 78 (docs/contracts.md), naming the path
    sys.exit(run_script(train))
