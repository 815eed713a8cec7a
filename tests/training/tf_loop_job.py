"""A custom TensorFlow training loop (GradientTape) made resumable with TFCheckpointer; run by the tests.

The Keras example's CSV step log and progress file (spot_training.training.training_log) and model
(spot_training/training/examples/keras_resnet.py), so the two paths are tested alike. Deterministic:
make_deterministic(seed), batches from the step number.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from spot_training.training.datasets import batch_indices, default_data_dir, load_digits, steps_per_epoch
from spot_training.training.notice import NoticeHandler
from spot_training.training.training_log import TrainingLog


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--save-every-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--save-final-weights", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    notices = NoticeHandler().install()  # before the slow TensorFlow import

    import keras
    import tensorflow as tf

    from spot_training.training.examples.keras_resnet import build_model
    from spot_training.training.keras_adapter import KerasCheckpointer, make_deterministic
    from spot_training.training.tf_loop import TFCheckpointer

    make_deterministic(args.seed)
    x, y = load_digits(default_data_dir(), "train")
    n, bs = len(x), args.batch_size
    spe = steps_per_epoch(n, bs)
    model = build_model(channels=args.channels)
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)  # slots exist before the restore (Keras 3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = loss_fn(yb, logits)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss, tf.reduce_mean(tf.cast(tf.equal(tf.cast(tf.argmax(logits, 1), yb.dtype), yb), tf.float32))

    ckpt = TFCheckpointer(model=model, optimizer=optimizer, every_steps=args.save_every_steps or None,
                          background=not args.sync, steps_per_epoch=spe, notices=notices)
    with TrainingLog(steps_total=args.epochs * spe) as log:
        for step in ckpt.steps(args.epochs * spe):
            idx = batch_indices(step, batch_size=bs, n=n, seed=args.seed)
            loss, accuracy = train_step(tf.constant(x[idx]), tf.constant(y[idx]))
            log.write(step + 1, step // spe, float(loss), float(accuracy))
            if args.step_delay:
                time.sleep(args.step_delay)
    if args.save_final_weights:
        model.compile(optimizer=optimizer)  # only so that KerasCheckpointer can list the optimizer's variables
        arrays, index = KerasCheckpointer(model).snapshot()
        np.savez(args.save_final_weights, **{e["key"]: arrays[e["key"]] for e in index})
    return 0


if __name__ == "__main__":
    sys.exit(main())
