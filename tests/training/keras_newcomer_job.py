"""A Keras script as a newcomer writes it, made resumable with ResumableFit; run by
tests/training/test_keras_newcomer.py.

    python keras_newcomer_job.py DATA_DIR CHECKPOINT_DIR OUT_DIR --data numpy|tfdata [--stop-at STEP]

BatchNorm + Dropout; ``class_weight``; ``sample_weight`` (numpy) or (x, y, w) dataset elements;
validation (``validation_split=0.2`` for numpy, the same split as ``validation_data`` with a
tf.data.Dataset); an EarlyStopping that stops after epoch 2 and a ReduceLROnPlateau that fires
after epochs 1 and 2 (their wait/best counters decide both); a CSVLogger; a callback that appends
every on_epoch_end and every validation run to OUT_DIR/events.txt. ``--stop-at STEP``: the
process sends itself a real SIGTERM after that global step. After fit: OUT_DIR/final.npz (every
model and optimizer variable) and OUT_DIR/callbacks.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--data", choices=("numpy", "tfdata"), required=True)
    parser.add_argument("--stop-at", type=int, default=None)
    args = parser.parse_args()

    from spot_training.training.keras_adapter import ResumableFit, make_deterministic

    make_deterministic(0)
    import keras
    import tensorflow as tf

    from spot_training.training.datasets import load_digits

    x, y = load_digits(args.data_dir, "train")
    x = x.reshape(len(x), -1)
    sample_weight = np.linspace(0.5, 1.5, len(x)).astype(np.float32)
    class_weight = {i: 1.0 + 0.1 * i for i in range(10)}
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32), keras.layers.BatchNormalization(),
                              keras.layers.ReLU(), keras.layers.Dropout(0.2), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    events = open(args.out_dir / "events.txt", "a", buffering=1)

    class Events(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            events.write(f"epoch_end {epoch}\n")

        def on_test_begin(self, logs=None):
            events.write("validation\n")

        def on_train_batch_end(self, batch, logs=None):
            if fitter.step == args.stop_at:
                os.kill(os.getpid(), signal.SIGTERM)

    early = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=5.0, patience=2)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", min_delta=5.0, patience=1, factor=0.5)
    csv_log = keras.callbacks.CSVLogger(str(args.out_dir / "epochs.csv"))
    callbacks = [Events(), early, plateau, csv_log]
    fitter = ResumableFit(model, args.checkpoint_dir, every_steps=20)
    if args.data == "numpy":
        fitter.fit(x, y, batch_size=32, epochs=6, validation_split=0.2, class_weight=class_weight,
                   sample_weight=sample_weight, callbacks=callbacks, verbose=0)
    else:
        split = int(np.floor(len(x) * 0.8))
        train = tf.data.Dataset.from_tensor_slices((x[:split], y[:split], sample_weight[:split]))
        fitter.fit(train.batch(32, drop_remainder=True), epochs=6, class_weight=class_weight,
                   validation_data=(x[split:], y[split:], sample_weight[split:]), callbacks=callbacks, verbose=0)
    arrays, index = fitter.checkpointer.snapshot()
    np.savez(args.out_dir / "final.npz", **{e["key"]: arrays[e["key"]] for e in index})
    state = {"early": [early.wait, early.best, early.stopped_epoch],
             "plateau": [plateau.wait, plateau.best, plateau.cooldown_counter],
             "lr": float(np.asarray(model.optimizer.learning_rate)), "step": fitter.step}
    (args.out_dir / "callbacks.json").write_text(json.dumps(state))
    return 0


if __name__ == "__main__":
    sys.exit(main())
