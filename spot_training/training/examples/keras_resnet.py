"""The article's training job with Keras 3: a small ResNet-style CNN on the 8x8 digits, resumable.

    python spot_training/training/examples/keras_resnet.py [--epochs 5] [--batch-size 32] [--save-every-steps 50]
        [--save-every-seconds S] [--seed 0] [--sync]

Reads ``<SPOT_TRAINING_DATA_DIR>/digits/{train,test}.npz`` (write it with
``python -m spot_training.training.examples.prepare_data``), checkpoints to ``SPOT_TRAINING_CHECKPOINT_DIR``
(default ``/dltraining/checkpoints``), appends one row per step to
``<SPOT_TRAINING_LOG_DIR>/training_log.csv`` (``step,epoch,loss,accuracy,wall_time``: step =
completed optimizer steps after that step, epoch 0-based, loss and accuracy as Keras reports them
for the epoch so far, wall_time in seconds since the epoch; the same columns as the Gluon twin).
SIGTERM: finish the step, save, exit 0. SIGUSR1 or the request file: extra checkpoint. Run it
again and it resumes at the exact step; after the last step it writes the final checkpoint and
``COMPLETED``.

Determinism: with the same ``--seed`` an interrupted and resumed run ends with weights bitwise
equal to an uninterrupted one: ``make_deterministic`` seeds Keras, turns on TensorFlow's
deterministic ops and pins one intra-op and one inter-op thread (a fixed summation order; on small
nodes also the fastest), the batches come from the step number, and the checkpoint holds every
variable including the Dropout layer's random-generator state.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `spot_training.training` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

# Before the slow imports (TensorFlow/Keras: seconds): a SIGTERM meanwhile is remembered and the run exits 0
# at its start instead of dying by the signal (docs/training.md, "A notice in any phase").
import spot_training.training.early_notice  # noqa: E402,F401

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from spot_training.training.core import (add_checkpoint_arguments, add_length_arguments, cadence_flag,
                                         parse_trainer_arguments, run_script)
from spot_training.training.datasets import default_data_dir, load_digits
from spot_training.training.training_log import TrainingLog


def build_model(*, channels: int = 16, blocks: int = 2, classes: int = 10, dropout: float = 0.1,
                input_shape=(8, 8, 1)):
    """A ResNet-style CNN for NHWC inputs (BatchNorm momentum 0.9, so a run of a few hundred steps evaluates well): conv-BN-ReLU stem, ``blocks`` residual blocks of
    ``channels`` (two 3x3 conv-BN with identity shortcut), global average pooling, Dropout(``dropout``),
    a ``classes``-way dense output (logits). Defaults: about 10 K parameters.

    Args:
        channels: convolution channels of the stem and every block (default 16).
        blocks: residual blocks (default 2).
        classes: output logits (default 10).
        dropout: Dropout rate before the output, 0..1 (0: no Dropout layer; default 0.1).
        input_shape: one example's shape, NHWC without the batch (default ``(8, 8, 1)``).

    Returns:
        an uncompiled ``keras.Model`` named ``resnet_digits``.
    """
    import keras
    from keras import layers

    inputs = keras.Input(input_shape)
    x = layers.Conv2D(channels, 3, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization(momentum=0.9)(x))
    for _ in range(blocks):
        y = layers.Conv2D(channels, 3, padding="same", use_bias=False)(x)
        y = layers.ReLU()(layers.BatchNormalization(momentum=0.9)(y))
        y = layers.Conv2D(channels, 3, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization(momentum=0.9)(y)
        x = layers.ReLU()(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling2D()(x)
    if dropout:
        x = layers.Dropout(dropout)(x)
    outputs = layers.Dense(classes)(x)
    return keras.Model(inputs, outputs, name="resnet_digits")


def parse_args(argv=None) -> argparse.Namespace:
    """The example's command line from ``argv`` (default ``sys.argv[1:]``; ``--help`` lists the options),
    checked: a bad value exits 2 naming it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_length_arguments(parser, steps=False)  # --epochs 5, --batch-size 32
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    add_checkpoint_arguments(parser)  # cadence (no default of its own), --keep, --sync, the directories
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads (default 1)")
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="sleep this many seconds after each step (tests use it to land signals mid-run)")
    parser.add_argument("--save-final-weights", type=Path, default=None,
                        help="also write the final weights and optimizer state to this .npz (for comparisons)")
    return parse_trainer_arguments(parser, argv, "threads")


def train(argv=None) -> int:
    """Train the ResNet on the digits with :class:`ResumableFit` (module docstring): parse ``argv``
    (:func:`parse_args`), resume from the newest checkpoint, return 0 after the last epoch. A stop notice:
    ``SystemExit(0)`` after its checkpoint; a checkpoint no restart can fix: ``CheckpointError`` (``run_script``
    below turns it into exit 74 or 78)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before TensorFlow: SIGTERM during the ~3 s import or model build must not kill us half-way.
    from spot_training.training.notice import NoticeHandler

    notice = NoticeHandler().install()
    import keras

    from spot_training.training.keras_adapter import ResumableFit, make_deterministic

    make_deterministic(args.seed, intra_op_threads=args.threads)
    data_dir = args.data_dir or default_data_dir()
    x_train, y_train = load_digits(data_dir, "train")
    x_test, y_test = load_digits(data_dir, "test")

    model = build_model(channels=args.channels, blocks=args.blocks, dropout=args.dropout)
    model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    fitter = ResumableFit(model, args.checkpoint_dir, seed=args.seed, every_steps=cadence_flag(args.save_every_steps),
                          every_seconds=cadence_flag(args.save_every_seconds), background=not args.sync, keep=args.keep,
                          notices=notice)

    class StepLog(keras.callbacks.Callback):
        """training_log.csv, one flushed row per step, appended across restarts, and progress.json."""

        def on_train_begin(self, logs=None):
            self.log = TrainingLog(args.log_dir, steps_total=args.epochs * fitter.steps_per_epoch)

        def on_train_batch_end(self, batch, logs=None):
            logs = logs or {}
            self.log.write(fitter.step, (fitter.step - 1) // fitter.steps_per_epoch, logs.get("loss", float("nan")),
                           logs.get("accuracy", float("nan")))
            if args.step_delay:
                time.sleep(args.step_delay)

        def on_train_end(self, logs=None):
            self.log.close()

    # On SIGTERM fit() writes the checkpoint and exits 0 (SystemExit): nothing below runs then.
    result = fitter.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                        callbacks=[StepLog()], verbose=0)
    notice.uninstall()
    _loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    logging.info("done: %d steps, test accuracy %.4f", result.step, accuracy)
    if args.save_final_weights:
        arrays, index = fitter.checkpointer.snapshot()
        np.savez(args.save_final_weights, **{e["key"]: arrays[e["key"]] for e in index})
    return 0


if __name__ == "__main__":
    # run_script: a checkpoint error that no restart can fix exits 74 or 78 (docs/contracts.md), naming the path
    sys.exit(run_script(train))
