"""A Gluon loop whose evaluation after each epoch takes about 40 s (inside ``outside_step()``), for
tests/mxnet/test_gluon_phases.py. ``python gluon_phase_job.py CHECKPOINT_DIR``: prints
``PHASE evaluation`` when the evaluation starts; no cadence saves (only the notice writes)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

SPE, BATCH = 20, 16


def main() -> int:
    import logging

    import mxnet as mx
    from mxnet import autograd, gluon

    from spot_training.training.mxnet_adapter import GluonCheckpointer, batch_indices

    logging.basicConfig(level=logging.INFO)
    mx.random.seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SPE * BATCH, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=SPE * BATCH).astype(np.float32)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu", in_units=8), gluon.nn.Dense(3, in_units=16))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-2})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    ckpt = GluonCheckpointer(net, trainer, checkpoint_dir=sys.argv[1], every_steps=None, steps_per_epoch=SPE)
    for step in ckpt.steps(2 * SPE):
        idx = batch_indices(step, batch_size=BATCH, n=len(x), seed=0)
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(x[idx])), mx.nd.array(y[idx]))
        loss.backward()
        trainer.step(BATCH)
        if (step + 1) % SPE == 0:
            with ckpt.outside_step():
                print("PHASE evaluation", flush=True)
                for i in range(200):
                    net(mx.nd.array(x[i:i + 1])).wait_to_read()
                    time.sleep(0.2)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
