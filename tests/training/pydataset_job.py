"""ResumableFit.fit on a keras.utils.PyDataset with worker processes, for test_pydataset.py.

    python pydataset_job.py CHECKPOINT_DIR OUT.npz [--stop-at STEP]

20 batches of 16 per epoch, 2 epochs, ``workers=2, use_multiprocessing=True``; every 5 steps a
checkpoint. ``--stop-at STEP``: after that global step a callback sends SIGTERM to the whole
process group (the trainer and its Keras workers), waits 0.5 s and prints ``WORKERS ALIVE a/n``.
OUT.npz: every model and optimizer variable after fit.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

SPE, BATCH = 20, 16


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--stop-at", type=int, default=None)
    args = parser.parse_args()

    from spot_training.training.keras_adapter import ResumableFit, make_deterministic

    make_deterministic(0)
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SPE * BATCH, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=SPE * BATCH)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return SPE

        def __getitem__(self, index):
            idx = np.random.default_rng(index).permutation(len(x))[:BATCH]
            return x[idx], y[idx]

    class StopAt(keras.callbacks.Callback):
        def __init__(self, fitter):
            super().__init__()
            self.fitter = fitter

        def on_train_batch_end(self, batch, logs=None):
            if self.fitter.step == args.stop_at:
                workers = multiprocessing.active_children()
                os.killpg(os.getpgid(0), signal.SIGTERM)
                time.sleep(0.5)
                alive = sum(p.is_alive() for p in workers)
                print(f"WORKERS ALIVE {alive}/{len(workers)}", flush=True)

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fitter = ResumableFit(model, args.checkpoint_dir, every_steps=5)
    fitter.fit(Batches(workers=2, use_multiprocessing=True), epochs=2, callbacks=[StopAt(fitter)], verbose=0)
    np.savez(args.out, **{f"{i:03d}": np.asarray(v) for i, v in
                          enumerate(list(model.variables) + list(model.optimizer.variables))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
