"""The TorchElastic agents (spot_training/agent/torch_elastic.py) with real stand-in processes: the coordinator's
store supervision and epochs, a worker's torchrun supervision, relaunch, report, and leave with notice."""

from __future__ import annotations

import shlex
import signal
import sys
import time
from pathlib import Path

import pytest

from spot_training.agent.cluster_state import ClusterConfig, settings_from_config
from spot_training.agent.errors import ConfigError
from spot_training.agent.torch_elastic import RendezvousState, TorchCoordinator, TorchWorker, torchrun_argv


def _coordinator_publishes(state: RendezvousState, worker: TorchWorker, *, host: str, epoch: int, node_id: str) -> None:
    """What a coordinator does: register (its address is a member's), then publish the rendezvous there."""
    worker.state.register({"node_id": node_id, "instance_id": node_id, "role": "scheduler", "host": host,
                           "port": 9000, "data_ready": True, "leaving": False, "registered_at": 0.0})
    state.publish(host=host, port=9000, epoch=epoch, node_id=node_id, since=0)


def _settings(tmp_path: Path, **kw) -> ClusterConfig:
    return ClusterConfig(state_dir=tmp_path / "cluster", num_servers=0, heartbeat_interval_s=0.2,
                           heartbeat_timeout_s=2.0, kill_grace_s=1.0, stop_timeout_s=5.0, **kw)


def test_torchrun_argv_has_the_elastic_flags():
    s = ClusterConfig(state_dir=Path("/x"), num_servers=0, min_workers=2, max_workers=5, torch_max_restarts=9,
                        torch_shutdown_timeout_s=60.0, torch_nproc_per_node=4)
    argv = torchrun_argv(python="/p", settings=s, endpoint="10.0.0.1:9000", run_id="Stack-3", local_addr="10.0.0.7",
                         training_argv=["/p", "-m", "train", "--steps", "5"])
    assert argv[:3] == ["/p", "-m", "torch.distributed.run"]
    for flag in ("--nnodes=2:5", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:9000",
                 "--rdzv-id=Stack-3", "--max-restarts=9", "--shutdown-timeout=60", "--local-addr=10.0.0.7"):
        assert flag in argv
    assert argv[argv.index("--no-python") + 1:] == ["/p", "-m", "train", "--steps", "5"]


def test_settings_accept_zero_servers_only_for_pytorch(tmp_path):
    section = {"state_dir": "/mnt/efs/cluster", "num_servers": 0, "torch_shutdown_timeout_s": 30}
    assert settings_from_config(section, framework="pytorch").torch_shutdown_timeout_s == 30.0
    with pytest.raises(ConfigError, match="cluster.num_servers: got 0; expected an integer 1..64"):
        settings_from_config(section, framework="mxnet")
    with pytest.raises(ConfigError, match="cluster.torch_nproc_per_node: got 0"):
        settings_from_config({**section, "torch_nproc_per_node": 0}, framework="pytorch")
    with pytest.raises(ConfigError, match="cluster.min_workers: got 3; expected at most max_workers"):
        settings_from_config({**section, "min_workers": 3, "max_workers": 2}, framework="pytorch")


def _coordinator(tmp_path, store_code: str) -> TorchCoordinator:
    # The stand-in store: ``python -m spot_training.training.distributed.torch_rendezvous`` is replaced through a
    # python that runs ``store_code`` whatever its arguments.
    shim = tmp_path / "python"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -c {shlex.quote(store_code)}\n")
    shim.chmod(0o755)
    return TorchCoordinator(_settings(tmp_path), node_id="i-coord", host="10.0.0.1", python=str(shim), environ={},
                            workdir=tmp_path, checkpoint_dir=tmp_path / "ckpt", log_dir=tmp_path / "logs")


def _until(agent, predicate, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        outcome = agent.step()
        if predicate(outcome):
            return outcome
        time.sleep(0.1)
    raise AssertionError("timed out")


@pytest.mark.integration
def test_coordinator_publishes_restarts_its_store_under_a_new_epoch_and_bumps_on_a_report(tmp_path):
    (tmp_path / "ckpt").mkdir()
    rdzv = RendezvousState(tmp_path / "cluster")
    rdzv.publish(host="10.0.0.9", port=9000, epoch=4, node_id="i-old", since=0)  # a replaced coordinator's
    coord = _coordinator(tmp_path, "import time; time.sleep(60)")
    coord._register()
    _until(coord, lambda _: coord.running is not None)
    assert (rdzv.read()["epoch"], rdzv.read()["host"]) == (5, "10.0.0.1")
    coord.running.proc.kill()  # the store dies: restarted under a new epoch
    _until(coord, lambda _: coord.running is not None and rdzv.read()["epoch"] == 6)
    rdzv.report("i-w1", 5, 1, time.time())  # an old epoch's report: ignored
    coord.step()
    assert rdzv.read()["epoch"] == 6
    rdzv.report("i-w1", 6, 1, time.time())  # this epoch's torchrun gave up: a new run id
    coord.step()
    assert rdzv.read()["epoch"] == 7 and rdzv.reports() == []
    (tmp_path / "ckpt" / "COMPLETED").write_text("")
    pid = coord.running.proc.pid
    assert _until(coord, lambda o: o is not None) == "completed"
    coord._stop_and_wait(1.0)
    assert coord.running is None
    with pytest.raises(ProcessLookupError):
        import os
        os.kill(pid, 0)


def _saving_on_sigterm(marker: Path, *, save_s: float, status: int) -> str:
    """A torchrun stand-in's source: it writes ``<marker>.ready`` and sleeps; on SIGTERM it "saves" for
    ``save_s`` seconds, writes ``ok`` to ``marker`` and exits ``status``."""
    return (f"import signal, sys, time\n"
            f"def stop(*a):\n    time.sleep({save_s}); open({str(marker)!r}, 'w').write('ok'); sys.exit({status})\n"
            f"signal.signal(signal.SIGTERM, stop)\nopen({str(marker) + '.ready'!r}, 'w').write('')\ntime.sleep(60)\n")


def _worker(tmp_path, script: str, monitors=()) -> TorchWorker:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "x").write_text("1")
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    shim = tmp_path / "python"  # stands in for ``python -m torch.distributed.run ...``
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -c {shlex.quote(script)}\n")
    shim.chmod(0o755)
    return TorchWorker(_settings(tmp_path, torch_shutdown_timeout_s=5.0), node_id="i-w1", host="10.0.0.5",
                       python=str(shim), training_argv=["train"], run_id_prefix="Stack", environ={},
                       workdir=tmp_path, checkpoint_dir=tmp_path / "ckpt", dataset_dir=tmp_path / "data",
                       log_dir=tmp_path / "logs", monitors=monitors, monitor_interval_s=0.0)


@pytest.mark.integration
def test_worker_waits_for_the_rendezvous_relaunches_and_reports_an_exit_it_did_not_ask_for(tmp_path):
    env_file = tmp_path / "env"
    # The stand-in records what torchrun would see: the opt-out of torch's shared rendezvous store, and
    # the node id that names its trainers' step logs (steps-<node_id>.csv).
    worker = _worker(tmp_path, "import os, sys; open(%r, 'w').write(os.environ.get('TORCH_DISABLE_SHARE_RDZV_TCP_STORE', '') "
                     "+ ' ' + os.environ.get('SPOT_TRAINING_NODE_ID', '')); sys.exit(3)" % str(env_file))
    worker._register()
    for _ in range(3):
        assert worker.step() is None
    assert worker.running is None and worker.launches == 0  # nothing published yet
    rdzv = worker.rdzv
    _coordinator_publishes(rdzv, worker, host="10.0.0.1", epoch=2, node_id="i-c")
    _until(worker, lambda _: worker.launches >= 2, timeout=20)  # exits 3, relaunched after the back-off
    assert [r["epoch"] for r in rdzv.reports()] == [2]
    assert env_file.read_text() == "1 i-w1"


@pytest.mark.integration
def test_worker_restarts_torchrun_when_the_epoch_moves_and_finishes_on_completed(tmp_path):
    worker = _worker(tmp_path, "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(1)); time.sleep(60)")
    rdzv = worker.rdzv
    _coordinator_publishes(rdzv, worker, host="10.0.0.1", epoch=1, node_id="i-c")
    _until(worker, lambda _: worker.running is not None)
    first = worker.running.proc.pid
    _coordinator_publishes(rdzv, worker, host="10.0.0.2", epoch=2, node_id="i-c2")  # a replacement coordinator
    _until(worker, lambda _: worker.running is not None and worker.running.epoch == 2, timeout=20)
    assert worker.running.proc.pid != first and worker.running.endpoint == "10.0.0.2:9000"
    assert rdzv.reports() == []  # the agent asked it to stop: no failure to report
    (tmp_path / "ckpt" / "COMPLETED").write_text("")
    worker.running.proc.send_signal(signal.SIGTERM)
    assert _until(worker, lambda o: o is not None) == "completed"


class _Notice:
    def __init__(self):
        self.fired = False

    def poll(self):
        from spot_training.agent.interruption import Event

        return Event(kind="spot-interruption", id="n1", detail={}) if self.fired else None


@pytest.mark.integration
def test_worker_leaving_sigterms_only_its_torchrun_and_waits_for_it(tmp_path):
    marker = tmp_path / "saved"
    # torchrun stand-in: on SIGTERM it "checkpoints" for 1 s, then exits non-zero (as torchrun does).
    script = _saving_on_sigterm(marker, save_s=1, status=143)
    notice = _Notice()
    worker = _worker(tmp_path, script, monitors=[notice])
    _coordinator_publishes(worker.rdzv, worker, host="10.0.0.1", epoch=1, node_id="i-c")
    _until(worker, lambda _: Path(str(marker) + ".ready").exists())
    notice.fired = True
    started = time.time()
    assert _until(worker, lambda o: o is not None) == "left"
    assert marker.read_text() == "ok" and time.time() - started >= 1.0
    assert worker.leave_reason == "spot-interruption" and worker.running is None
    assert worker.rdzv.reports() == []


@pytest.mark.integration
def test_worker_whose_trainer_exits_74_is_not_relaunched_and_exits_74(tmp_path):
    """The contract's restart policy (TRAINER_EXIT_POLICY): full or unusable checkpoint storage is
    permanent, so the worker gives up with the same status instead of relaunching every 2 s."""
    from spot_training.agent.errors import CheckpointStorageError

    worker = _worker(tmp_path, "import sys; sys.exit(74)")
    worker._register()
    _coordinator_publishes(worker.rdzv, worker, host="10.0.0.1", epoch=1, node_id="i-c")
    with pytest.raises(CheckpointStorageError, match="exited 74") as info:
        _until(worker, lambda _: worker.launches >= 2, timeout=10)
    assert info.value.exit_code == 74 and worker.launches == 1
    assert "i-w1" not in worker.state.registrations() and worker.rdzv.reports() == []


def test_cluster_settings_refuse_a_zero_heartbeat_interval():
    section = {"state_dir": "/mnt/efs/cluster", "num_servers": 1}
    with pytest.raises(ConfigError, match=r"cluster.heartbeat_interval_s: got 0; expected a number of seconds above 0"):
        settings_from_config({**section, "heartbeat_interval_s": 0})
    with pytest.raises(ConfigError, match=r"cluster.stop_timeout_s: got 0"):
        settings_from_config({**section, "stop_timeout_s": 0})
    assert settings_from_config({**section, "kill_grace_s": 0, "debounce_s": 0}).kill_grace_s == 0.0


class _FlakyImdsThenNotice:
    """IMDS unavailable on the first polls (a blip), then nothing, then a spot notice due in 20 s."""

    def __init__(self):
        self.polls, self.fire = 0, False

    def poll(self):
        import datetime as dt

        from spot_training.agent.imds import ImdsUnavailableError
        from spot_training.agent.interruption import Event

        self.polls += 1
        if self.polls <= 2:
            raise ImdsUnavailableError("GET /latest/meta-data/spot/instance-action: timed out")
        if not self.fire:
            return None
        deadline = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=20)
        return Event(kind="spot-interruption", id="n1", deadline=deadline, detail={"action": "terminate"})


@pytest.mark.integration
def test_worker_keeps_training_through_an_imds_blip_and_leaves_through_a_checkpoint_by_the_notice_deadline(tmp_path):
    """One interruption pipeline: a transient IMDS error is retried (it ended the agent loop, whose
    cleanup SIGKILLed torchrun without a checkpoint), and the wait for the checkpoint runs to the
    notice's deadline minus the agent's margin (20 - 15 = 5 s here), not a fixed
    torch_shutdown_timeout_s + kill_grace_s (1 + 1 s here), which killed a 3 s save."""
    marker = tmp_path / "saved"
    script = _saving_on_sigterm(marker, save_s=3, status=0)
    monitor = _FlakyImdsThenNotice()
    worker = _worker(tmp_path, script, monitors=[monitor])
    worker.settings = _settings(tmp_path, torch_shutdown_timeout_s=1.0)
    _coordinator_publishes(worker.rdzv, worker, host="10.0.0.1", epoch=1, node_id="i-c")
    _until(worker, lambda _: Path(str(marker) + ".ready").exists() and monitor.polls > 2)
    assert worker.running is not None and not worker.leaving  # still training after the blip
    monitor.fire = True
    assert _until(worker, lambda o: o is not None, timeout=30) == "left"
    assert marker.read_text() == "ok" and worker.leave_reason == "spot-interruption"
    assert worker.last_exit == 0  # it saved and exited; it was not killed


def test_worker_asks_for_a_checkpoint_on_a_rebalance_recommendation_and_keeps_training(tmp_path):
    from spot_training.agent.interruption import Event

    class Rebalance:
        def poll(self):
            return Event(kind="rebalance-recommendation", id="r1", detail={})

    worker = _worker(tmp_path, "import time; time.sleep(60)", monitors=[Rebalance()])
    request = tmp_path / "ckpt" / "CHECKPOINT_REQUEST"
    worker.environ["SPOT_TRAINING_CHECKPOINT_REQUEST_FILE"] = str(request)
    worker._poll_monitors()
    assert request.is_file() and not worker.leaving
    request.unlink()
    worker._last_monitor = float("-inf")
    worker._poll_monitors()  # the same recommendation is acted on once
    assert not request.exists()
