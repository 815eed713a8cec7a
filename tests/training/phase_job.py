"""A trainer that spends a long time outside its training steps, for tests/training/test_phases.py.

    python phase_job.py keras|tf CHECKPOINT_DIR [--epochs N]

``keras``: ``ResumableFit.fit`` with ``validation_data`` whose pass takes about 40 s (each of 200
batches sleeps 0.2 s in the input pipeline), 20 training steps per epoch. ``tf``: a custom loop on
``TFCheckpointer.steps`` whose evaluation after each epoch (inside ``outside_step()``) takes about
40 s. Both print ``PHASE evaluation`` when the long pass starts and ``DONE`` after training.
No cadence saves (``every_steps=None``): only the notice writes a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

SPE, BATCH, EVAL_BATCHES, EVAL_SLEEP_S = 20, 16, 200, 0.2


def slow(x):
    time.sleep(EVAL_SLEEP_S)
    return x


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("keras", "tf"))
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    import logging
    logging.basicConfig(level=logging.INFO)

    from spot_training.training.keras_adapter import make_deterministic

    make_deterministic(0)
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SPE * BATCH, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=SPE * BATCH)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss_fn)
    val = (tf.data.Dataset.from_tensor_slices((x[:EVAL_BATCHES], y[:EVAL_BATCHES])).batch(1)
           .map(lambda a, b: (tf.ensure_shape(tf.numpy_function(slow, [a], tf.float32), [None, 8]), b)))

    if args.mode == "keras":
        from spot_training.training.keras_adapter import ResumableFit

        class Phase(keras.callbacks.Callback):
            def on_test_begin(self, logs=None):
                print("PHASE evaluation", flush=True)

        ResumableFit(model, args.checkpoint_dir, every_steps=None).fit(
            x, y, batch_size=BATCH, epochs=args.epochs, validation_data=val, callbacks=[Phase()], verbose=0)
    else:
        from spot_training.training.datasets import batch_indices
        from spot_training.training.tf_loop import TFCheckpointer

        model.optimizer.build(model.trainable_variables)

        @tf.function
        def train_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            model.optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        ckpt = TFCheckpointer(model=model, optimizer=model.optimizer, checkpoint_dir=args.checkpoint_dir,
                              every_steps=None, steps_per_epoch=SPE)
        for step in ckpt.steps(args.epochs * SPE):
            idx = batch_indices(step, batch_size=BATCH, n=len(x), seed=0)
            train_step(x[idx], y[idx])
            if (step + 1) % SPE == 0:
                with ckpt.outside_step():
                    print("PHASE evaluation", flush=True)
                    for xb, yb in val:
                        model(xb, training=False)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
