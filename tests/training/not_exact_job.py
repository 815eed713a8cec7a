"""Trainers whose resume cannot be bitwise, for tests/training/test_not_exact.py.

    python not_exact_job.py keras|tf ROOT

Each mode first trains an exact variant (a control: no warning may appear), writes the line
``CONTROL DONE`` to stderr, then the inexact one: ``keras``, ``ResumableFit.fit`` on a tf.data
pipeline that reshuffles on every iteration (twice, to show the warning is logged once); ``tf``,
a custom loop whose traced step draws from ``tf.random.normal`` (a stateful op).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def main() -> int:
    mode, root = sys.argv[1], Path(sys.argv[2])
    logging.basicConfig(level=logging.WARNING)
    from spot_training.training.keras_adapter import ResumableFit, make_deterministic

    make_deterministic(0)
    import keras
    import tensorflow as tf

    from spot_training.training.tf_loop import TFCheckpointer

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = rng.integers(0, 2, size=64)

    def model():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        m.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        m.optimizer.build(m.trainable_variables)
        return m

    base = tf.data.Dataset.from_tensor_slices((x, y))
    if mode == "keras":
        ResumableFit(model(), root / "control", every_steps=None).fit(
            base.shuffle(64, seed=1, reshuffle_each_iteration=False).batch(16), epochs=1, verbose=0)
        print("CONTROL DONE", file=sys.stderr, flush=True)
        for run in ("a", "b"):
            ResumableFit(model(), root / run, every_steps=None).fit(base.shuffle(64).batch(16), epochs=1, verbose=0)
        return 0

    def loop(directory: Path, noise) -> None:
        m = model()

        @tf.function
        def train_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = m.loss(yb, m(xb + noise(tf.shape(xb)), training=True))
            m.optimizer.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)

        for step in TFCheckpointer(model=m, optimizer=m.optimizer, checkpoint_dir=directory,
                                   every_steps=None).steps(3):
            train_step(x[step * 16:step * 16 + 16], y[step * 16:step * 16 + 16])

    loop(root / "control", lambda shape: tf.random.get_global_generator().normal(shape, stddev=0.1))
    print("CONTROL DONE", file=sys.stderr, flush=True)
    loop(root / "stateful", lambda shape: tf.random.normal(shape, stddev=0.1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
