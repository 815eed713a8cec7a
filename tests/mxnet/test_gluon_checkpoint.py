"""The Gluon adapter in this process (MXNet imported here: this directory has a pytest of its own):
restore round trip, fallback past a corrupt newest checkpoint, bad input that must fail clearly and lose nothing."""

from __future__ import annotations

import json
import logging
import pickle
import signal

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

from spot_training.training.examples.gluon_resnet import build_net
from spot_training.training.mxnet_adapter import (PARAMS_FILE, TRAINER_FILE, WRITER_NICE, GluonCheckpointer, GluonState,
                                   StatesPickler, sync_distributed_parameters)
from spot_training.training.notice import NoticeHandler
from spot_training.training.store import (
    CheckpointError,
    CheckpointPathError,
    CheckpointStore,
    FrameworkMismatchError,
    ShapeMismatchError,
)

pytestmark = pytest.mark.mxnet

RNG = np.random.default_rng(0)
X = mx.nd.array(RNG.random((8, 1, 8, 8), dtype=np.float32))
Y = mx.nd.array(RNG.integers(0, 10, 8))


def make(channels: int = 4, seed: int = 0):
    mx.random.seed(seed)
    net = build_net(channels=channels, blocks=1)
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01}, update_on_kvstore=False)
    return net, trainer


def train_step(net, trainer):
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(X), Y)
    loss.backward()
    trainer.step(8)


def params_of(net) -> dict[str, np.ndarray]:
    return {k: p.data().asnumpy() for k, p in net._collect_params_with_prefix().items()}


def checkpointer(net, trainer, directory, **kwargs) -> GluonCheckpointer:
    # No signal handlers from these in-process tests (request_file None: env not consulted).
    kwargs.setdefault("notices", NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=()))
    return GluonCheckpointer(net, trainer, directory=directory, **kwargs)


def files_under(path):
    return sorted((p.relative_to(path).as_posix(), p.stat().st_size) for p in path.rglob("*") if p.is_file())


def trained_with_checkpoints(tmp_path, steps: int, background: bool = False, **model):
    """A model (``make(**model)``) trained ``steps`` steps with a checkpoint after each, into
    ``tmp_path``; returns (net, trainer, its checkpointer, still open)."""
    net, trainer = make(**model)
    ck = checkpointer(net, trainer, tmp_path, every_steps=1, background=background)
    for _ in range(steps):
        train_step(net, trainer)
        ck.after_step()
    return net, trainer, ck


@pytest.mark.parametrize("background", [True, False])
def test_restore_brings_back_params_optimizer_state_and_step(tmp_path, background):
    net, trainer = make()
    ck = checkpointer(net, trainer, tmp_path, every_steps=2, background=background, steps_per_epoch=3)
    for _ in range(4):
        train_step(net, trainer)
        ck.after_step()
    ck.close()
    saved = params_of(net)
    train_step(net, trainer)  # the original goes on one more step...
    expected = params_of(net)

    net2, trainer2 = make(seed=1)  # ...and a fresh process restores and takes the same step
    ck2 = checkpointer(net2, trainer2, tmp_path)
    assert ck2.restore() == 4
    assert ck2.restored.epoch == 1 and ck2.restored.framework == "mxnet"
    assert ck2.restored.manifest["framework_version"] == mx.__version__
    for name, value in saved.items():
        assert np.array_equal(params_of(net2)[name], value), name
    train_step(net2, trainer2)
    for name, value in expected.items():
        assert np.array_equal(params_of(net2)[name], value), name  # Adam moments and t came back too
    ck2.close()


def test_restore_maps_optimizer_state_by_parameter_name_when_the_trainer_orders_them_differently(tmp_path):
    net, trainer, ck = trained_with_checkpoints(tmp_path, steps=3)
    ck.close()
    train_step(net, trainer)
    expected = params_of(net)

    mx.random.seed(0)
    net2 = build_net(channels=4, blocks=1)
    net2.initialize(mx.init.Xavier())
    # Same model, trainer given the parameters in reverse: every optimizer index differs.
    reordered = list(reversed(list(net2.collect_params().values())))
    trainer2 = gluon.Trainer(reordered, "adam", {"learning_rate": 0.01}, update_on_kvstore=False)
    ck2 = checkpointer(net2, trainer2, tmp_path)
    assert ck2.restore() == 3
    train_step(net2, trainer2)
    for name, value in expected.items():
        assert np.array_equal(params_of(net2)[name], value), name
    ck2.close()


def test_restore_without_checkpoint_starts_at_step_0_and_leaves_the_model(tmp_path):
    net, trainer = make()
    before = params_of(net)
    ck = checkpointer(net, trainer, tmp_path / "new")
    assert ck.restore() == 0 and ck.restored is None
    assert all(np.array_equal(params_of(net)[k], v) for k, v in before.items())
    ck.close()


def test_parameter_broadcast_is_a_no_op_without_a_distributed_kvstore():
    net, trainer = make()
    assert sync_distributed_parameters(trainer) is False
    assert not trainer._kv_initialized  # left for Gluon to do lazily, as without the adapter


def test_parameter_broadcast_waits_for_deferred_initialization_and_says_so(caplog):
    # A dist kvstore type name without a cluster: the deferred parameter stops it before any kvstore call.
    net = gluon.nn.Dense(4)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="dist_sync",
                            update_on_kvstore=False)
    with caplog.at_level(logging.WARNING, logger="training.mxnet"):
        assert sync_distributed_parameters(trainer) is False
    assert "not initialized yet" in caplog.text and "weight" in caplog.text


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    net, trainer, ck = trained_with_checkpoints(tmp_path, steps=3)
    ck.close()
    newest = tmp_path / "ckpt-000000000003" / PARAMS_FILE
    blob = bytearray(newest.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # one flipped byte in the middle of the parameters
    newest.write_bytes(bytes(blob))
    before = files_under(tmp_path)

    net2, trainer2 = make(seed=3)
    ck2 = checkpointer(net2, trainer2, tmp_path)
    with caplog.at_level(logging.WARNING):
        assert ck2.restore() == 2
    assert "ckpt-000000000003" in caplog.text and "sha256" in caplog.text
    assert files_under(tmp_path) == before  # the corrupt one is kept for inspection
    ck2.close()


def test_torn_newest_checkpoint_without_manifest_falls_back(tmp_path, caplog):
    net, trainer, ck = trained_with_checkpoints(tmp_path, steps=2)
    ck.close()
    (tmp_path / "ckpt-000000000002" / "manifest.json").unlink()
    ck2 = checkpointer(*make(seed=3), tmp_path)
    with caplog.at_level(logging.WARNING):
        assert ck2.restore() == 1
    assert "ckpt-000000000002" in caplog.text and "missing" in caplog.text
    ck2.close()


def test_fails_when_checkpoint_path_is_a_file_exiting_74_naming_the_path(tmp_path, caplog):
    path = tmp_path / "checkpoints"
    path.write_text("not a directory\n")
    with pytest.raises(SystemExit) as info:  # docs/contracts.md: 74, checkpoint storage unusable
        checkpointer(*make(), path)
    assert info.value.code == 74
    assert isinstance(info.value.__cause__, CheckpointPathError)
    assert "CheckpointPathError" in caplog.text and str(path) in caplog.text
    assert path.read_text() == "not a directory\n"


def test_fails_when_checkpoint_was_written_by_tensorflow(tmp_path):
    tf_store = CheckpointStore(tmp_path, framework="tensorflow", framework_version="2.17.1")
    tf_store.save(lambda d: (d / "ckpt-1.index").write_bytes(b"tf index"), step=10, epoch=0)
    before = files_under(tmp_path)
    net, trainer = make()
    params = params_of(net)
    ck = checkpointer(net, trainer, tmp_path)
    with pytest.raises(FrameworkMismatchError) as info:
        ck.restore()
    message = str(info.value)
    assert str(tmp_path / "ckpt-000000000010") in message and "'tensorflow'" in message and "'mxnet'" in message
    assert files_under(tmp_path) == before
    assert all(np.array_equal(params_of(net)[k], v) for k, v in params.items())
    ck.close()


def test_fails_when_mxnet_checkpoint_was_not_written_by_the_gluon_adapter(tmp_path):
    CheckpointStore(tmp_path, framework="mxnet").save(
        lambda d: (d / "model-0001.params").write_bytes(b"module checkpoint"), step=3, epoch=0)
    before = files_under(tmp_path)
    ck = checkpointer(*make(), tmp_path)
    with pytest.raises(CheckpointError, match=r"ckpt-000000000003.*adapter=None, adapter_format=None"):
        ck.restore()
    assert files_under(tmp_path) == before
    ck.close()


def test_fails_when_model_shapes_do_not_match_naming_path_parameter_and_shapes(tmp_path):
    net, trainer, ck = trained_with_checkpoints(tmp_path, steps=1, channels=4)
    ck.close()
    before = files_under(tmp_path)

    wider, wider_trainer = make(channels=6)
    params = params_of(wider)
    ck2 = checkpointer(wider, wider_trainer, tmp_path)
    with pytest.raises(ShapeMismatchError) as info:
        ck2.restore()
    message = str(info.value)
    assert str(tmp_path / "ckpt-000000000001") in message
    assert "parameter '0.weight': checkpoint has shape (4, 1, 3, 3), model has shape (6, 1, 3, 3)" in message
    assert files_under(tmp_path) == before  # nothing deleted
    assert all(np.array_equal(params_of(wider)[k], v) for k, v in params.items())  # nothing loaded
    ck2.close()


def test_fails_when_model_has_other_parameters(tmp_path):
    net, trainer, ck = trained_with_checkpoints(tmp_path, steps=1)
    ck.close()
    mx.random.seed(0)
    other = build_net(channels=4, blocks=1, width=8)  # one more Dense layer
    other.initialize()
    ck2 = checkpointer(other, gluon.Trainer(other.collect_params(), "adam", update_on_kvstore=False), tmp_path)
    with pytest.raises(ShapeMismatchError, match=r"missing from the checkpoint: \['7.bias', '7.weight'\]"):
        ck2.restore()
    ck2.close()


def test_checkpoint_files_are_what_gluon_itself_reads(tmp_path):
    net, trainer, ck = trained_with_checkpoints(tmp_path, steps=1, background=True)
    ckpt = ck.save(wait=True) or CheckpointStore(tmp_path, framework="mxnet").latest()
    ck.close()
    net2, trainer2 = make(seed=5)
    trainer2.load_states(str(ckpt.path / TRAINER_FILE))  # MXNet's own readers
    assert trainer2.optimizer.num_update == 1
    net2.load_parameters(str(ckpt.path / PARAMS_FILE))
    for name, value in params_of(net).items():
        assert np.array_equal(params_of(net2)[name], value), name
    assert json.loads((ckpt.path / "manifest.json").read_text())["metadata"]["adapter"] == "gluon"


def test_background_saves_reuse_two_sets_of_host_arrays_and_each_commits_its_own_step(tmp_path):
    net, trainer = make()
    ck = checkpointer(net, trainer, tmp_path, every_steps=None, background=True, keep=3)
    expected = {}
    for step in (1, 2, 3):
        train_step(net, trainer)
        ck.step = step
        ck.save()  # no wait: the next step overwrites the live arrays while this write may run
        expected[step] = params_of(net)
        if step == 1:
            first_set = {name: id(array) for name, array in ck._host_buffers[0].params.items()}
    ck.save(wait=True)
    assert {name: id(array) for name, array in ck._host_buffers[0].params.items()} == first_set  # step 3 reused step 1's
    assert set(id(a) for a in ck._host_buffers[1].params.values()).isdisjoint(first_set.values())
    store = CheckpointStore(tmp_path, framework="mxnet")
    for step in (1, 2, 3):
        saved = mx.nd.load(str(tmp_path / f"ckpt-{step:012d}" / PARAMS_FILE))
        for name, value in expected[step].items():
            assert np.array_equal(saved[name].asnumpy(), value), (step, name)
    assert store.latest().step == 3
    ck.close()
    assert ck._host_buffers == [None, None]


def test_states_pickler_writes_the_objects_pickle_writes(tmp_path):
    net, trainer = make()
    for _ in range(2):
        train_step(net, trainer)
    updater = trainer._updaters[0]
    path = tmp_path / "trainer.states"
    with open(path, "wb") as handle:
        StatesPickler(handle).dump((updater.states, updater.optimizer))
    ours = pickle.loads(path.read_bytes())
    plain = pickle.loads(pickle.dumps((updater.states, updater.optimizer)))
    assert sorted(ours[0]) == sorted(plain[0]) and len(ours[0]) > 4
    for index, state in plain[0].items():
        for mine, theirs in zip(ours[0][index], state):  # Adam: (mean, variance), distinct per parameter
            assert type(mine) is type(theirs) and np.array_equal(mine.asnumpy(), theirs.asnumpy()), index
    assert ours[1].num_update == plain[1].num_update == 2
    make()[1].load_states(str(path))  # Gluon's own reader


def test_fails_when_steps_argument_is_invalid(tmp_path):
    ck = checkpointer(*make(), tmp_path)
    with pytest.raises(ValueError, match="total_steps=0"):
        next(ck.steps(0))
    with pytest.raises(ValueError, match="steps_per_epoch=True"):
        checkpointer(*make(), tmp_path, steps_per_epoch=True)
    ck.close()


def test_steps_on_sigterm_saves_the_finished_step_and_exits_0(tmp_path):
    net, trainer = make()
    ck = GluonCheckpointer(net, trainer, directory=tmp_path, every_steps=None,
                           notices=NoticeHandler(request_file=None))
    done = []
    with pytest.raises(SystemExit) as info:
        for step in ck.steps(100):
            train_step(net, trainer)
            done.append(step)
            if step == 6:
                signal.raise_signal(signal.SIGTERM)
    assert info.value.code == 0
    assert done == list(range(7))
    assert CheckpointStore(tmp_path, framework="mxnet").latest().step == 7
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    assert not ck.notices._previous  # handlers uninstalled


def test_background_writer_thread_runs_at_lower_cpu_priority_and_training_thread_does_not(tmp_path):
    import os
    import threading

    net, trainer = make()
    train_step(net, trainer)
    seen = {}
    original = GluonState.write

    def spy(self, directory):
        original(self, directory)
        seen[threading.current_thread().name] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    GluonState.write = spy
    try:
        ck = checkpointer(net, trainer, tmp_path / "bg", every_steps=1, background=True)
        ck.after_step()
        ck.close()
        ck = checkpointer(net, trainer, tmp_path / "sync", every_steps=1, background=False)
        ck.after_step()
        ck.close()
    finally:
        GluonState.write = original
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == {"checkpoint-writer": max(WRITER_NICE, main_nice), "MainThread": main_nice}, seen


class _Payload:
    """A pickle that runs ``touch MARKER`` when it is loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_payload_in_trainer_states_is_refused_naming_the_file_and_never_runs(tmp_path):
    from spot_training.training.mxnet_adapter import load_state

    net, trainer, ck = trained_with_checkpoints(tmp_path / "ckpt", steps=1)
    ckpt = CheckpointStore(tmp_path / "ckpt", framework="mxnet").latest()
    ck.close()
    marker = tmp_path / "ran"
    (ckpt.path / TRAINER_FILE).write_bytes(pickle.dumps(((0, {}), _Payload(marker))))
    net2, trainer2 = make(seed=5)
    before = params_of(net2)
    with pytest.raises(CheckpointError, match=r"trainer\.states: refers to (posix|os)\.system"):
        from spot_training.training.mxnet_adapter import trainer_order
        load_state(net2, trainer2, ckpt.path, saved_order=trainer_order(net2, trainer2))
    assert not marker.exists()
    for name, value in before.items():  # refused before any parameter changed
        assert np.array_equal(params_of(net2)[name], value), name
