"""Worker for test_dist_init.py: one ``dist_sync`` step of a 20-layer MLP, then the weights' SHA-256.

    DMLC_ROLE=worker DMLC_PS_ROOT_URI=... python dist_init_job.py CHECKPOINT_DIR

Builds the model with known input sizes (no deferred initialization), restores through
:class:`spot_training.training.mxnet_adapter.GluonCheckpointer` as a training script does (an empty directory: the
restore finds nothing and only broadcasts rank 0's parameters), runs one step on a batch drawn from
its rank, and prints one JSON line ``{"rank", "sha256"}`` over every parameter after the update.
Many layers mean many kvstore keys, each one a chance for the broadcast pull to lose the race
against the first gradient push (spot_training/training/mxnet_adapter.sync_distributed_parameters).
"""

import hashlib
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from mxnet.gluon import nn  # noqa: E402

from spot_training.training.mxnet_adapter import GluonCheckpointer  # noqa: E402
from spot_training.training.notice import NoticeHandler  # noqa: E402

LAYERS = 20
GLOBAL_BATCH = 64


def main() -> int:
    kv = mx.kv.create("dist_sync")
    mx.random.seed(0)
    net = nn.HybridSequential()
    for _ in range(LAYERS):
        net.add(nn.Dense(64, activation="relu", in_units=64))
    net.add(nn.Dense(10, in_units=64))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                            kvstore=kv, update_on_kvstore=False)
    ckpt = GluonCheckpointer(net, trainer, directory=sys.argv[1], every_steps=None, background=False,
                             notices=NoticeHandler(request_file=None))
    ckpt.restore()
    rng = np.random.default_rng(kv.rank)
    x = mx.nd.array(rng.random((GLOBAL_BATCH // kv.num_workers, 64), dtype=np.float32))
    y = mx.nd.array(rng.integers(0, 10, GLOBAL_BATCH // kv.num_workers))
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
    loss.backward()
    trainer.step(GLOBAL_BATCH)
    digest = hashlib.sha256()
    for _, param in sorted(net.collect_params().items()):
        digest.update(param.data().asnumpy().tobytes())
    print(json.dumps({"rank": kv.rank, "sha256": digest.hexdigest()}), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # ps-lite's exit barrier can hang once the scheduler is gone (mxnet_dist.run)
