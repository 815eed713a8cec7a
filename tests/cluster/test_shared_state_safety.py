"""Root agents and the cluster's shared storage (EFS, writable by every node's training user).

Every file the cluster agents create, append, read or remove there goes through
spot_training.agent.safepath: a symlink, hard link or FIFO the training user plants makes the agent
refuse (or treat the file as absent), never write through it as root. Every record read is typed
(``cluster_state.SCHEMAS``): a wrongly typed file is logged and ignored, never a crash, and a
rendezvous never sends torchrun to an address that is not the registered coordinator's.

The planting tests need root (the agent's situation on an instance); the schema tests run anywhere.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import sys
from pathlib import Path

import pytest
from root_helpers import training_user_tree

from spot_training.agent.cluster_state import ClusterState, Plan, make_plan
from spot_training.agent.safepath import UnsafePathError
from spot_training.agent.process_group import ProcessGroup
from spot_training.agent.torch_elastic import RendezvousState, TorchWorker
from spot_training.agent.cluster_state import ClusterConfig

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the agent's situation on a node")
USER = "nobody"


@pytest.fixture()
def efs():
    """``efs/`` owned by the training user ('nobody', as on a cluster's EFS), ``secret/`` root-only."""
    with training_user_tree("spot-efs-", "efs", USER) as base:
        yield base


def plant(path: Path, *, symlink_to: Path | None = None, hardlink_to: Path | None = None, directory: bool = False) -> None:
    """What the training user can do on EFS: a symlink, hard link or directory of theirs."""
    account = pwd.getpwnam(USER)
    if symlink_to is not None:
        path.symlink_to(symlink_to)
    elif hardlink_to is not None:
        os.link(hardlink_to, path)
        return
    elif directory:
        path.mkdir()
    os.lchown(path, account.pw_uid, account.pw_gid)


def untouched(base: Path, *names: str) -> None:
    secret = base / "secret"
    assert secret.stat().st_uid == 0 and stat.S_IMODE(secret.stat().st_mode) == 0o700
    assert (secret / "shadow").read_text() == "root:secret\n"
    assert sorted(p.name for p in secret.iterdir()) == sorted(["shadow", *names])


# ---- writes as root -------------------------------------------------------------------------------
@needs_root
@pytest.mark.parametrize("variant", ["file-symlink", "dir-symlink", "hardlink"])
def test_planted_cluster_log_does_not_make_root_write_through_it(efs, variant):
    """The reproduction: a link planted where a node's log goes (/mnt/efs/logs/<role>-<node>.log)
    used to make root append the process's output to any file (a root-owned /etc/cron.d entry)."""
    logs = efs / "efs" / "logs"
    if variant == "dir-symlink":
        plant(logs, symlink_to=efs / "secret")
    else:
        plant(logs, directory=True)
        if variant == "file-symlink":
            plant(logs / "worker-i-1.log", symlink_to=efs / "secret" / "shadow")
        else:
            plant(logs / "worker-i-1.log", hardlink_to=efs / "secret" / "shadow")
    with pytest.raises(UnsafePathError):
        ProcessGroup.start(["/bin/echo", "* * * * * root sh /tmp/x"], cwd="/", env={},
                           log_path=logs / "worker-i-1.log")
    untouched(efs)


@pytest.mark.integration
@needs_root
def test_cluster_log_is_written_and_owned_by_the_process_user_on_a_clean_share(efs):
    account = pwd.getpwnam(USER)
    logs = efs / "efs" / "logs"
    plant(logs, directory=True)
    group = ProcessGroup.start(["/bin/echo", "hello"], cwd="/", env={}, log_path=logs / "worker-i-1.log",
                               user=(account.pw_uid, account.pw_gid, []))
    assert group.proc.wait(timeout=10) == 0
    path = logs / "worker-i-1.log"
    assert path.read_text() == "hello\n" and path.stat().st_uid == account.pw_uid


@needs_root
def test_planted_events_jsonl_symlink_is_not_appended_to(efs):
    state_dir = efs / "efs" / "cluster"
    plant(state_dir, directory=True)
    state = ClusterState(state_dir)
    plant(state_dir / "events.jsonl", symlink_to=efs / "secret" / "shadow")
    plan = make_plan(generation=1, framework="mxnet", scheduler={"node_id": "s", "host": "10.0.0.1", "port": 9000},
                     servers=[], workers=[], now=1.0, reason="test")
    with pytest.raises(UnsafePathError):
        state.write_plan(plan)
    untouched(efs)


@needs_root
@pytest.mark.parametrize("sub", ["registrations", "heartbeats"])
def test_planted_state_directory_symlink_is_not_written_into(efs, sub):
    state_dir = efs / "efs" / "cluster"
    plant(state_dir, directory=True)
    plant(state_dir / sub, symlink_to=efs / "secret")
    with pytest.raises(UnsafePathError):
        ClusterState(state_dir)
    untouched(efs)


@needs_root
def test_planted_registration_symlink_is_replaced_not_followed(efs):
    state_dir = efs / "efs" / "cluster"
    plant(state_dir, directory=True)
    state = ClusterState(state_dir)
    plant(state_dir / "registrations" / "i-1.json", symlink_to=efs / "secret" / "shadow")
    state.register({"node_id": "i-1", "instance_id": "i-1", "role": "worker", "host": "10.0.0.2", "port": 9002,
                    "data_ready": True, "leaving": False, "registered_at": 1.0})
    untouched(efs)
    assert not (state_dir / "registrations" / "i-1.json").is_symlink()
    assert set(state.registrations()) == {"i-1"}


@needs_root
def test_planted_reports_directory_symlink_does_not_make_root_delete_files(efs):
    state_dir = efs / "efs" / "cluster"
    plant(state_dir, directory=True)
    (efs / "secret" / "keep.json").write_text("{}")
    rdzv = RendezvousState(state_dir)
    os.rmdir(state_dir / "rendezvous-reports")
    plant(state_dir / "rendezvous-reports", symlink_to=efs / "secret")
    rdzv.clear_reports()  # logged, nothing removed
    assert rdzv.reports() == []
    untouched(efs, "keep.json")


@needs_root
def test_planted_fifo_rendezvous_does_not_block_the_agent(efs):
    state_dir = efs / "efs" / "cluster"
    plant(state_dir, directory=True)
    rdzv = RendezvousState(state_dir)
    os.mkfifo(state_dir / "rendezvous.json")
    assert rdzv.read() is None


# ---- typed records --------------------------------------------------------------------------------
def _settings(tmp_path: Path) -> ClusterConfig:
    return ClusterConfig(state_dir=tmp_path / "cluster", num_servers=0, heartbeat_interval_s=0.2,
                           heartbeat_timeout_s=2.0, kill_grace_s=1.0, stop_timeout_s=5.0)


BAD_RECORDS = [
    [1, 2, 3], "text", None, {"host": ["10.0.0.1"], "port": 9000, "epoch": 1, "node_id": "i-c", "since": 0},
    {"host": "10.0.0.1", "port": "9000", "epoch": 1, "node_id": "i-c", "since": 0},
    {"host": "10.0.0.1", "port": 9000, "epoch": "x", "node_id": "i-c", "since": 0},
    {"host": "10.0.0.1", "port": 10 ** 30, "epoch": 1, "node_id": "i-c", "since": 0},
    {"host": "10.0.0.1 --rdzv-backend=x", "port": 9000, "epoch": 1, "node_id": "i-c", "since": 0},
    {"host": "10.0.0.1", "port": 9000, "epoch": 1, "node_id": {"a": 1}, "since": 0},
    {"host": "10.0.0.1", "port": 9000, "epoch": 1, "node_id": "../../etc", "since": 0},
    {"host": "10.0.0.1", "port": 9000, "epoch": 1, "node_id": "i-c", "since": "NaN"},
]


def _worker(tmp_path: Path) -> TorchWorker:
    return TorchWorker(_settings(tmp_path), node_id="i-w1", host="10.0.0.5", python=sys.executable,
                       training_argv=["-c", "pass"], run_id_prefix="Stack", environ={}, workdir=tmp_path,
                       checkpoint_dir=tmp_path / "ckpt", dataset_dir=None, log_dir=tmp_path / "logs")


@pytest.mark.parametrize("content", BAD_RECORDS + ["{not json", "[" * 100000, '{"port": NaN}'])
def test_wrongly_typed_rendezvous_is_absent_not_a_crash(tmp_path, content):
    worker = _worker(tmp_path)
    text = content if isinstance(content, str) and not content.startswith("text") else json.dumps(content)
    (tmp_path / "cluster" / "rendezvous.json").write_text(text)
    assert worker.rdzv.read() is None
    assert worker.step() is None and worker.running is None and worker.launches == 0


def test_rendezvous_pointing_outside_the_registered_coordinator_is_ignored(tmp_path):
    worker = _worker(tmp_path)
    worker.state.register({"node_id": "i-c", "instance_id": "i-c", "role": "scheduler", "host": "10.0.0.1",
                           "port": 9000, "data_ready": True, "leaving": False, "registered_at": 0.0})
    worker.state.register({"node_id": "i-w2", "instance_id": "i-w2", "role": "worker", "host": "10.0.0.7",
                           "port": 9000, "data_ready": True, "leaving": False, "registered_at": 0.0})
    for host, node_id in (("203.0.113.9", "i-c"), ("10.0.0.1", "i-unknown"), ("10.0.0.7", "i-w2")):
        worker.rdzv.publish(host=host, port=9000, epoch=1, node_id=node_id, since=0)
        assert worker.step() is None and worker.launches == 0, (host, node_id)


@pytest.mark.parametrize("content", BAD_RECORDS)
def test_wrongly_typed_state_files_are_ignored(tmp_path, content):
    state = ClusterState(tmp_path / "cluster")
    good = {"node_id": "i-1", "instance_id": "i-1", "role": "worker", "host": "10.0.0.2", "port": 9002,
            "data_ready": True, "leaving": False, "registered_at": 1.0}
    state.register(good)
    for directory in (state.registrations_dir, state.heartbeats_dir, tmp_path / "cluster" / "rendezvous-reports"):
        directory.mkdir(exist_ok=True)
        (directory / "i-bad.json").write_text(json.dumps(content))
    (state.registrations_dir / "i-2.json").write_text(json.dumps({**good, "node_id": "i-1"}))  # names another node
    (state.registrations_dir / "i-3.json").write_text(json.dumps({**good, "node_id": "i-3", "role": ["worker"]}))
    (state.registrations_dir / "i-4.json").write_text(json.dumps({**good, "node_id": "i-4", "host": "x" * 100}))
    assert state.registrations() == {"i-1": good}
    assert state.heartbeats() == {}
    assert RendezvousState(tmp_path / "cluster").reports() == []
    state.plan_path.write_text(json.dumps(content))
    assert state.plan() is None
    (state.events_path).write_text(json.dumps(content) + "\n{bad\n" + json.dumps(
        {"time": 1, "generation": 1, "state": "running"}) + "\n")
    assert state.events() == [{"time": 1, "generation": 1, "state": "running"}]


@pytest.mark.parametrize("mutate", [
    lambda p: p.update(generation="1"), lambda p: p.update(workers=[{"node_id": "w"}]),
    lambda p: p.update(scheduler=None), lambda p: p.update(servers={"a": 1}), lambda p: p.update(state=["running"]),
    lambda p: p["workers"][0].update(host="evil.example.com"), lambda p: p["workers"][0].update(rank=-1),
])
def test_wrongly_typed_plan_is_absent(tmp_path, mutate):
    state = ClusterState(tmp_path / "cluster")
    plan = make_plan(generation=1, framework="mxnet", scheduler={"node_id": "s", "host": "10.0.0.1", "port": 9000},
                     servers=[{"node_id": "p", "host": "10.0.0.2", "port": 9001}],
                     workers=[{"node_id": "w", "host": "10.0.0.3", "port": 9002}], now=1.0, reason="r")
    state.write_plan(plan)
    assert state.plan() == Plan.from_dict(plan.to_dict())
    data = plan.to_dict()
    mutate(data)
    state.plan_path.write_text(json.dumps(data))
    assert state.plan() is None


def test_a_state_file_replaced_between_open_and_check_is_read_not_refused(tmp_path, monkeypatch):
    """A heartbeat is rewritten every second (write_bytes_atomic: rename over the old file). When the
    rename lands between the reader's open and its fstat, the file it holds has 0 links: that is the
    old, complete file, not a planted hard link, so it is read (the coordinator once declared a live
    worker dead for it)."""
    from spot_training.agent import safepath

    path = tmp_path / "i-w1.json"
    safepath.write_bytes_atomic(path, b'{"beat": 1}')
    real_open, raced = os.open, []

    def open_then_writer_renames(name, flags, *args, **kwargs):
        fd = real_open(name, flags, *args, **kwargs)
        if name == path.name and not raced:
            raced.append(True)
            safepath.write_bytes_atomic(path, b'{"beat": 2}')
        return fd

    monkeypatch.setattr(os, "open", open_then_writer_renames)
    assert safepath.read_bytes(path, limit=1000) == b'{"beat": 1}' and raced
    assert safepath.read_bytes(path, limit=1000) == b'{"beat": 2}'
