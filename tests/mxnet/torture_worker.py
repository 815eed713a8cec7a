"""Worker for test_gluon_torture.py: restore with the Gluon adapter, then train and checkpoint on every
step until killed. Prints ``restored <step>`` once the restore finished and ``saved <step>`` after each
save call. A model of about 0.3 M parameters with Adam makes each checkpoint about 3.6 MB, so most of the
worker's time is spent writing checkpoints and a random SIGKILL usually lands mid-write.

    python torture_worker.py CHECKPOINT_DIR background|sync
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from mxnet.gluon import nn  # noqa: E402

from spot_training.training.mxnet_adapter import GluonCheckpointer  # noqa: E402
from spot_training.training.notice import NoticeHandler  # noqa: E402


def main() -> int:
    directory, mode = sys.argv[1], sys.argv[2]
    mx.random.seed(0)
    net = nn.HybridSequential()
    with net.name_scope():
        net.add(nn.Dense(512, activation="relu", in_units=64), nn.Dense(512, in_units=512), nn.Dense(10, in_units=512))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-4}, update_on_kvstore=False)
    ckpt = GluonCheckpointer(net, trainer, directory=directory, every_steps=1, keep=2,
                             background=(mode == "background"), notices=NoticeHandler(request_file=None))
    step = ckpt.restore()
    print(f"restored {step}", flush=True)
    rng = np.random.default_rng(0)
    x = mx.nd.array(rng.random((16, 64), dtype=np.float32))
    y = mx.nd.array(rng.integers(0, 10, 16))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    while True:
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(16)
        ckpt.after_step()
        print(f"saved {ckpt.step}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
