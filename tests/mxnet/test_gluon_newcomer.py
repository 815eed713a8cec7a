"""What a newcomer's Gluon script hit, in this process (MXNet imported: own pytest):
deferred initialization (``nn.Dense(64)`` without ``in_units``) and ``Dropout`` drawing from
MXNet's generator. A "restart" is a fresh net and trainer built with another MXNet seed, as a new
process would be, restored from the same directory; the result must be bitwise equal to a run
that was never interrupted."""

from __future__ import annotations

import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

from spot_training.training.mxnet_adapter import GluonCheckpointer
from spot_training.training.notice import NoticeHandler
from spot_training.training.store import CheckpointStore

pytestmark = pytest.mark.mxnet

RNG = np.random.default_rng(0)
X = mx.nd.array(RNG.random((16, 1, 8, 8), dtype=np.float32))
Y = mx.nd.array(RNG.integers(0, 10, 16))


def build(seed: int, *, deferred: bool, dropout: bool):
    mx.random.seed(seed)
    net = nn.HybridSequential()
    net.add(nn.Dense(64, activation="relu", **({} if deferred else {"in_units": 64})))
    if dropout:
        net.add(nn.Dropout(0.5))
    net.add(nn.Dense(10, **({} if deferred else {"in_units": 64})))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01}, update_on_kvstore=False)
    return net, trainer


def run(directory, total, *, deferred, dropout, seed, stop_after=None):
    """One process's worth of training; returns (params, steps run)."""
    net, trainer = build(seed, deferred=deferred, dropout=dropout)
    notices = NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=())
    ck = GluonCheckpointer(net, trainer, checkpoint_dir=directory, every_steps=3, notices=notices)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    ran = []
    try:
        for step in ck.steps(total):
            with autograd.record():
                loss = loss_fn(net(X), Y)
            loss.backward()
            trainer.step(16)
            ran.append(step)
            if stop_after is not None and len(ran) == stop_after:
                notices.request_stop()
    except SystemExit as exit_:
        assert exit_.code == 0
    params = {k: p.data().asnumpy() for k, p in net._collect_params_with_prefix().items()}
    return params, ran


def assert_bitwise(actual, expected):
    assert sorted(actual) == sorted(expected)
    differing = [k for k in expected if actual[k].tobytes() != expected[k].tobytes()]
    assert not differing, f"differ from the uninterrupted run: {differing}"


def test_deferred_initialization_net_resumes_and_a_completed_job_restarts_cleanly(tmp_path):
    reference, _ = run(tmp_path / "ref", 10, deferred=True, dropout=False, seed=0)
    _, first = run(tmp_path / "job", 10, deferred=True, dropout=False, seed=0, stop_after=4)
    assert first == [0, 1, 2, 3]
    resumed, second = run(tmp_path / "job", 10, deferred=True, dropout=False, seed=0)
    assert second == list(range(4, 10))
    assert_bitwise(resumed, reference)
    assert CheckpointStore(tmp_path / "job", framework="mxnet").is_complete()
    # Restarting the COMPLETED job (as a supervisor would after a reboot) runs nothing and exits cleanly.
    again, third = run(tmp_path / "job", 10, deferred=True, dropout=False, seed=5)
    assert third == []
    assert_bitwise(again, reference)


@pytest.mark.parametrize("deferred", [False, True])
def test_dropout_resumes_bitwise_equal(tmp_path, deferred):
    reference, _ = run(tmp_path / "ref", 12, deferred=deferred, dropout=True, seed=0)
    run(tmp_path / "job", 12, deferred=deferred, dropout=True, seed=0, stop_after=5)  # 5: not a save step
    # The restarted process seeds MXNet differently: only the adapter can make the masks match.
    resumed, second = run(tmp_path / "job", 12, deferred=deferred, dropout=True, seed=1234)
    assert second == list(range(5, 12))
    assert_bitwise(resumed, reference)


def test_uninterrupted_dropout_runs_differ_with_another_rng_seed(tmp_path):
    # The test above cannot pass by accident: the masks do depend on the seed the adapter uses.
    a, _ = run(tmp_path / "a", 6, deferred=False, dropout=True, seed=0)
    net, trainer = build(0, deferred=False, dropout=True)
    notices = NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=())
    ck = GluonCheckpointer(net, trainer, checkpoint_dir=tmp_path / "b", every_steps=3, notices=notices, seed=1)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in ck.steps(6):
        with autograd.record():
            loss = loss_fn(net(X), Y)
        loss.backward()
        trainer.step(16)
    b = {k: p.data().asnumpy() for k, p in net._collect_params_with_prefix().items()}
    assert any(a[k].tobytes() != b[k].tobytes() for k in a)


def test_reseeding_is_automatic_only_for_nets_with_dropout(tmp_path):
    quiet = dict(notices=NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=()))
    plain = GluonCheckpointer(*build(0, deferred=False, dropout=False), checkpoint_dir=tmp_path / "a", **quiet)
    dropout = GluonCheckpointer(*build(0, deferred=False, dropout=True), checkpoint_dir=tmp_path / "b", **quiet)
    forced = GluonCheckpointer(*build(0, deferred=False, dropout=False), checkpoint_dir=tmp_path / "c", seed=3,
                               **quiet)
    assert (plain.adapter.seed, dropout.adapter.seed, forced.adapter.seed) == (None, 0, 3)
    with pytest.raises(ValueError, match="seed=-1"):
        GluonCheckpointer(*build(0, deferred=False, dropout=False), checkpoint_dir=tmp_path / "d", seed=-1, **quiet)
    for ck in (plain, dropout, forced):
        ck.close()


def test_old_option_names_warn_and_still_work(tmp_path):
    net, trainer = build(0, deferred=False, dropout=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = GluonCheckpointer(net, trainer, directory=tmp_path, every_steps=4,
                               notices=NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=()))
    assert ck.directory == tmp_path
    assert any(w.category is DeprecationWarning and "'checkpoint_dir'" in str(w.message) for w in caught)
    ck.close()
