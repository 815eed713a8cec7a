"""The phase drill's TensorFlow trainer: Keras ``ResumableFit.fit`` or a custom loop on ``TFCheckpointer``.

    python -m bench.notice.tf_job keras|tf --checkpoint-dir DIR --log STEPS.csv [--epochs 3] [--workers 0]
        [--validation-s 0] [--save-every-steps 7] [--step-delay 0.05] [--final OUT.npz]

Run from the repository root with ``-m`` (a script's own directory would shadow ``keras``). A dense
network (16 -> 512 -> 512 -> 3 with Dropout, about 0.27 M parameters, Adam) on 10 fixed batches of
16 per epoch. ``keras``: the batches come from a ``keras.utils.PyDataset`` (``--workers N > 0``: N
worker processes); ``tf``: from the step number (``batch_indices``), ``tf.function`` step.
``--validation-s S``: after the first epoch a validation pass of about S seconds (20 batches, each
sleeping S/20 in the input pipeline; Keras's own ``validation_data`` pass, or the loop's evaluation
inside ``ckpt.outside_step()``). Prints ``PHASE fit`` just before training starts (the first trace
follows) and ``PHASE validation`` when the pass starts; appends ``step,wall_time`` per completed
step to ``--log``; ``--final``: every model and optimizer variable after the last step (.npz).
SIGTERM: the front-end saves and exits 0. Deterministic (``make_deterministic(0)``).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SPE, BATCH, FEATURES, WIDTH, VAL_BATCHES = 10, 16, 16, 512, 20


def main(argv: list[str] | None = None) -> int:
    """Train the phase job in ``mode`` (module docstring); returns the exit status (0 after a notice)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("keras", "tf"))
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0, help="PyDataset worker processes (keras; 0: none)")
    parser.add_argument("--validation-s", type=float, default=0.0)
    parser.add_argument("--save-every-steps", type=int, default=7)
    parser.add_argument("--step-delay", type=float, default=0.05)
    parser.add_argument("--final", type=Path, default=None)
    args = parser.parse_args(argv)
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from spot_training.training.notice import NoticeHandler

    notices = NoticeHandler().install()  # before the slow TensorFlow import
    import numpy as np

    from spot_training.training.keras_adapter import make_deterministic

    make_deterministic(0)
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SPE * BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, 3, size=SPE * BATCH)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(WIDTH, activation="relu"),
                              keras.layers.Dropout(0.1), keras.layers.Dense(WIDTH, activation="relu"),
                              keras.layers.Dense(3)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss_fn)
    epoch = {"now": 0}

    def slow(a):
        if epoch["now"] == 0:  # the long pass once (after the first epoch): a resume does not repeat it
            time.sleep(args.validation_s / VAL_BATCHES)
        return a

    args.log.parent.mkdir(parents=True, exist_ok=True)
    new = not args.log.exists()
    log = open(args.log, "a", newline="", buffering=1)
    writer = csv.writer(log)
    if new:
        writer.writerow(["step", "wall_time"])
    every = args.save_every_steps or None

    if args.mode == "keras":
        from spot_training.training.keras_adapter import ResumableFit

        class Batches(keras.utils.PyDataset):
            def __init__(self, count, delay=False, **kwargs):
                super().__init__(**kwargs)
                self.count, self.delay = count, delay

            def __len__(self):
                return self.count

            def __getitem__(self, index):
                idx = np.random.default_rng(index).permutation(len(x))[:BATCH]
                return (slow(x[idx]) if self.delay else x[idx]), y[idx]

        fitter = ResumableFit(model, args.checkpoint_dir, every_steps=every, notices=notices)

        class Drill(keras.callbacks.Callback):
            def on_epoch_begin(self, index, logs=None):
                epoch["now"] = index

            def on_test_begin(self, logs=None):
                print("PHASE validation", flush=True)

            def on_train_batch_end(self, batch, logs=None):
                writer.writerow([fitter.step, f"{time.time():.3f}"])
                time.sleep(args.step_delay)

        data = (Batches(SPE, workers=args.workers, use_multiprocessing=True) if args.workers
                else Batches(SPE))
        val = Batches(VAL_BATCHES, delay=True) if args.validation_s else None
        print("PHASE fit", flush=True)
        fitter.fit(data, epochs=args.epochs, validation_data=val, callbacks=[Drill()], verbose=0)
        arrays, index = fitter.checkpointer.snapshot()
    else:
        from spot_training.training.datasets import batch_indices
        from spot_training.training.keras_adapter import KerasCheckpointer
        from spot_training.training.tf_loop import TFCheckpointer

        optimizer = model.optimizer
        optimizer.build(model.trainable_variables)  # slots exist before the restore (Keras 3)

        @tf.function
        def train_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss

        ckpt = TFCheckpointer(model=model, optimizer=optimizer, checkpoint_dir=args.checkpoint_dir,
                              every_steps=every, steps_per_epoch=SPE, notices=notices)
        print("PHASE fit", flush=True)
        for step in ckpt.steps(args.epochs * SPE):
            idx = batch_indices(step, batch_size=BATCH, n=len(x), seed=0)
            train_step(tf.constant(x[idx]), tf.constant(y[idx]))
            writer.writerow([step + 1, f"{time.time():.3f}"])
            time.sleep(args.step_delay)
            if args.validation_s and step + 1 == SPE:
                with ckpt.outside_step():  # a notice here saves step + 1 at once
                    print("PHASE validation", flush=True)
                    for i in range(VAL_BATCHES):
                        model(tf.constant(slow(x[i:i + BATCH])), training=False)
                epoch["now"] = 1
        arrays, index = KerasCheckpointer(model).snapshot()
    log.close()
    if args.final:
        np.savez(args.final, **{e["key"]: arrays[e["key"]] for e in index})
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
