"""Supervisor against real trainer processes (a tiny Python script using spot_training.training.notice)."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from git_helpers import two_version_repo

from spot_training.agent.config import parse_config
from spot_training.agent.errors import ConfigError, ExitCode
from spot_training.agent.supervisor import (CHECKPOINT_REQUEST_FILE, CheckpointMismatchError, CheckpointStorageError,
                                  Outcome, ProcessGroup, Supervisor, TrainerFailedError, VolumeNotMountedError)

REPO = Path(__file__).resolve().parents[2]

# The fake trainer: steps of 20 ms; honours the contract (SIGTERM -> save, exit 0; request file or
# SIGUSR1 -> extra checkpoint; COMPLETED after the last step) and records what it did in events.log.
TRAINER = r'''
import json, os, sys, time
from pathlib import Path
from spot_training.training.notice import NoticeHandler

ckpt = Path(os.environ["SPOT_TRAINING_CHECKPOINT_DIR"])
events = ckpt / "events.log"
mode = os.environ.get("FAKE_MODE", "train")
steps = int(os.environ.get("FAKE_STEPS", "1000000"))

def record(*parts):
    with open(events, "a") as f:
        f.write(" ".join(str(p) for p in parts) + "\n")

record("start", os.getpid(), os.getpgid(0), os.getuid(), os.getcwd())
if os.environ.get("FAKE_DUMP_ENV"):
    (ckpt / "env.json").write_text(json.dumps({k: v for k, v in os.environ.items() if k.startswith("SPOT_TRAINING_")}))
if mode == "crash":
    sys.exit(3)
if mode == "crash-once" and not (ckpt / "crashed-once").exists():
    (ckpt / "crashed-once").write_text("")
    sys.exit(4)
if mode == "exit0":
    sys.exit(0)
if mode == "checkpoint-mismatch":
    sys.exit(78)
if mode == "storage-full":
    sys.exit(74)
if mode == "ignore-sigterm":
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
step = int((ckpt / "step").read_text()) if (ckpt / "step").exists() else 0
with NoticeHandler() as notices:
    while step < steps:
        time.sleep(0.02)
        step += 1
        if notices.consume_checkpoint_request():
            record("extra-checkpoint", step)
        if notices.stop_requested:
            (ckpt / "step").write_text(str(step))
            record("sigterm-checkpoint", step)
            sys.exit(0)
(ckpt / "step").write_text(str(step))
(ckpt / "COMPLETED").write_text(json.dumps({"step": step, "epoch": 0, "wall_time": time.time()}))
record("completed", step)
'''


def base_config(root: Path, *, user: str | None = None, code: dict | None = None) -> dict:
    """A valid node config whose paths all live under ``root``; the trainer is TRAINER."""
    code_dir = root / "code"
    code_dir.mkdir(parents=True, exist_ok=True)
    (code_dir / "trainer.py").write_text(TRAINER)
    mount = root / "dltraining"
    mount.mkdir(exist_ok=True)
    return {
        "schema_version": 1, "region": "us-east-1", "stack_name": "SpotTraining", "node_role": "single",
        "volume": {"tags": {"spot-training:stack": "SpotTraining", "spot-training:purpose": "data-volume"},
                   "device_name": "/dev/sdf", "mount_point": str(mount), "fs_type": "xfs", "keep_snapshots": 2},
        "efs": None,
        "training": {"framework": "tensorflow", "python": sys.executable, "command": ["{python}", "trainer.py"],
                     "user": user or pwd.getpwuid(os.geteuid()).pw_name,
                     "dataset_dir": str(mount / "datasets"), "checkpoint_dir": str(mount / "checkpoints"),
                     "log_dir": str(mount / "logs"), "code": code or {"type": "asset", "path": str(code_dir)}},
        "cleanup": {"cancel_fleet_on_success": True}, "imds_endpoint": None,
    }


def make_supervisor(root: Path, *, env: dict | None = None, config: dict | None = None, **kwargs) -> Supervisor:
    environ = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    kwargs.setdefault("backoff_base_s", 0.01)
    kwargs.setdefault("backoff_max_s", 0.1)
    return Supervisor(parse_config(config or base_config(root)), is_mounted=kwargs.pop("is_mounted", lambda: True),
                      environ=environ, poll_s=0.05, **kwargs)


def events(root: Path) -> list[list[str]]:
    path = root / "dltraining" / "checkpoints" / "events.log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.mark.integration
def test_runs_trainer_to_completion_with_the_contract_environment(tmp_path):
    sup = make_supervisor(tmp_path, env={"FAKE_STEPS": "5", "FAKE_DUMP_ENV": "1"})
    assert sup.run() is Outcome.COMPLETED
    ckpt = tmp_path / "dltraining" / "checkpoints"
    env = json.loads((ckpt / "env.json").read_text())
    assert env == {"SPOT_TRAINING_DATA_DIR": str(tmp_path / "dltraining" / "datasets"),
                   "SPOT_TRAINING_CHECKPOINT_DIR": str(ckpt),
                   "SPOT_TRAINING_LOG_DIR": str(tmp_path / "dltraining" / "logs"),
                   "SPOT_TRAINING_CHECKPOINT_REQUEST_FILE": str(ckpt / CHECKPOINT_REQUEST_FILE)}
    start, completed = events(tmp_path)
    pid, pgid, _uid, cwd = start[1:]
    assert pid == pgid  # its own process group, so SIGTERM reaches the whole trainer
    assert cwd == str(tmp_path / "code")
    assert completed == ["completed", "5"]
    assert (tmp_path / "dltraining" / "datasets").is_dir() and (tmp_path / "dltraining" / "logs").is_dir()


@pytest.mark.integration
def test_checkpoint_cadence_of_the_node_config_reaches_the_trainer_environment(tmp_path):
    # cdk.json -> node config `training.checkpoint_every_*` -> the trainer's environment.
    config = base_config(tmp_path)
    config["training"].update(checkpoint_every_steps=7, checkpoint_every_seconds=90)
    sup = make_supervisor(tmp_path, env={"FAKE_STEPS": "3", "FAKE_DUMP_ENV": "1"}, config=config)
    assert sup.run() is Outcome.COMPLETED
    env = json.loads((tmp_path / "dltraining" / "checkpoints" / "env.json").read_text())
    assert env["SPOT_TRAINING_CHECKPOINT_EVERY_STEPS"] == "7"
    assert env["SPOT_TRAINING_CHECKPOINT_EVERY_SECONDS"] == "90"


@pytest.mark.integration
def test_a_bad_checkpoint_cadence_is_a_config_error(tmp_path):
    config = base_config(tmp_path)
    config["training"]["checkpoint_every_steps"] = 0
    with pytest.raises(ConfigError, match="training.checkpoint_every_steps: got 0"):
        parse_config(config)


@pytest.mark.integration
def test_crashing_trainer_is_restarted_with_bounded_backoff_then_given_up(tmp_path):
    clock = FakeClock()
    sup = make_supervisor(tmp_path, env={"FAKE_MODE": "crash"}, max_restarts=3, backoff_base_s=1.0,
                          backoff_max_s=3.0, clock=clock, sleep=clock.sleep, rng=lambda: 1.0)
    with pytest.raises(TrainerFailedError, match="failed 4 times in a row, more than max_restarts=3") as info:
        sup.run()
    assert info.value.exit_code == ExitCode.TEMPFAIL
    assert [e[0] for e in events(tmp_path)] == ["start"] * 4  # 1 start + 3 restarts, then no more
    # Backoff 1 s, 2 s, then capped at 3 s (jitter pinned to its top by rng=1.0).
    assert sup.restarts == 3 and clock.now == pytest.approx(1.0 + 2.0 + 3.0)


@pytest.mark.integration
def test_a_single_crash_is_restarted_and_training_resumes(tmp_path):
    sup = make_supervisor(tmp_path, env={"FAKE_MODE": "crash-once", "FAKE_STEPS": "3"})
    assert sup.run() is Outcome.COMPLETED
    assert [e[0] for e in events(tmp_path)] == ["start", "start", "completed"]
    assert sup.restarts == 1


@pytest.mark.integration
@pytest.mark.parametrize("mode, error, message, code, status", [
    # docs/contracts.md: 74 = checkpoint storage full or unusable; a restart would fail the same way.
    ("storage-full", CheckpointStorageError, "exited 74.*checkpoint storage", ExitCode.CHECKPOINT_STORAGE, 74),
    # docs/contracts.md: 78 = the newest checkpoint is another framework's, adapter's or model's.
    ("checkpoint-mismatch", CheckpointMismatchError, "exited 78.*cannot serve this job", ExitCode.CONFIG, 78),
])
def test_trainer_exit_74_or_78_is_permanent_and_not_restarted(tmp_path, mode, error, message, code, status):
    sup = make_supervisor(tmp_path, env={"FAKE_MODE": mode}, max_restarts=5)
    with pytest.raises(error, match=message) as info:
        sup.run()
    assert info.value.exit_code == code == status
    if mode == "storage-full":
        assert str(tmp_path) in str(info.value)  # names the checkpoint storage
    assert [e[0] for e in events(tmp_path)] == ["start"] and sup.restarts == 0


@pytest.mark.integration
def test_exit_0_without_completed_is_not_completion(tmp_path):
    sup = make_supervisor(tmp_path, env={"FAKE_MODE": "exit0"}, max_restarts=1)
    with pytest.raises(TrainerFailedError, match="exited 0 without writing COMPLETED"):
        sup.run()
    assert len(events(tmp_path)) == 2


def test_never_starts_training_when_the_volume_is_not_mounted(tmp_path):
    sup = make_supervisor(tmp_path, is_mounted=lambda: False)
    with pytest.raises(VolumeNotMountedError, match="not mounted at .*refusing to start training on the root disk"):
        sup.run()
    assert events(tmp_path) == []
    assert not (tmp_path / "dltraining" / "checkpoints").exists()


@pytest.mark.integration
def test_volume_lost_before_a_restart_stops_restarts(tmp_path):
    mounted = iter([True, True, False])  # run(), first start, the restart
    sup = make_supervisor(tmp_path, env={"FAKE_MODE": "crash"}, is_mounted=lambda: next(mounted))
    with pytest.raises(VolumeNotMountedError):
        sup.run()
    assert len(events(tmp_path)) == 1


def test_completed_at_boot_goes_straight_to_cleanup(tmp_path):
    ckpt = tmp_path / "dltraining" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETED").write_text('{"step": 10, "epoch": 1, "wall_time": 0}')
    sup = make_supervisor(tmp_path)
    assert sup.run() is Outcome.COMPLETED
    assert events(tmp_path) == [] and sup.starts == 0


@pytest.mark.integration
def test_agent_stop_sends_sigterm_and_is_not_completion(tmp_path):
    sup = make_supervisor(tmp_path)
    outcome: list[Outcome] = []
    thread = threading.Thread(target=lambda: outcome.append(sup.run()))
    thread.start()
    deadline = time.monotonic() + 20
    while not events(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    sup.request_stop()
    thread.join(timeout=20)
    assert outcome == [Outcome.STOPPED]
    assert sup.last_status == 0
    assert events(tmp_path)[-1][0] == "sigterm-checkpoint"


@pytest.mark.integration
def test_request_checkpoint_by_signal(tmp_path):
    sup = make_supervisor(tmp_path, checkpoint_request="signal")
    thread = threading.Thread(target=sup.run)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not events(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the trainer installs its handlers right after recording "start"
        assert sup.request_checkpoint() is True
        while "extra-checkpoint" not in [e[0] for e in events(tmp_path)] and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sup.request_stop()
        thread.join(timeout=20)
    assert [e[0] for e in events(tmp_path)] == ["start", "extra-checkpoint", "sigterm-checkpoint"]


def test_request_checkpoint_without_a_trainer_says_so(tmp_path):
    assert make_supervisor(tmp_path).request_checkpoint() is False


@pytest.mark.integration
def test_drops_privileges_to_the_training_user(tmp_path):
    # A root that "nobody" can traverse (pytest's tmp_path is 0700); a shell trainer, since the
    # venv's interpreter lives under /root, which "nobody" cannot read.
    root = Path(tempfile.mkdtemp(prefix="spot-sup-", dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        config = base_config(root, user="nobody")
        config["training"]["command"] = ["/bin/sh", "-c", 'id -u > "$SPOT_TRAINING_CHECKPOINT_DIR/uid" && '
                                         'echo "{}" > "$SPOT_TRAINING_CHECKPOINT_DIR/COMPLETED"']
        sup = make_supervisor(root, config=config)
        assert sup.run() is Outcome.COMPLETED
        ckpt = root / "dltraining" / "checkpoints"
        expected = pwd.getpwnam("nobody").pw_uid if os.geteuid() == 0 else os.geteuid()
        assert int((ckpt / "uid").read_text()) == expected
        assert ckpt.stat().st_uid == expected
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)


def test_unknown_training_user_is_a_config_error_when_root(tmp_path):
    sup = make_supervisor(tmp_path, config=base_config(tmp_path, user="no_such_user_x"))
    if os.geteuid() == 0:
        with pytest.raises(ConfigError, match="training.user: 'no_such_user_x' does not exist"):
            sup.run()
        assert events(tmp_path) == []
    else:  # not root: runs as the current user whatever the config says
        sup.environ["FAKE_STEPS"] = "1"
        assert sup.run() is Outcome.COMPLETED


def test_missing_asset_directory_is_a_config_error(tmp_path):
    config = base_config(tmp_path, code={"type": "asset", "path": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match="training.code.path: '.*nowhere' is not a directory"):
        make_supervisor(tmp_path, config=config).run()


@pytest.mark.integration
def test_git_code_is_cloned_at_the_pinned_ref_idempotently(tmp_path):
    repo, v2 = two_version_repo(tmp_path, {"trainer.py": TRAINER})

    config = base_config(tmp_path, code={"type": "git", "url": str(repo), "ref": "v1"})
    sup = make_supervisor(tmp_path, config=config, env={"FAKE_STEPS": "1"})
    workspace = sup.workspace.prepare_code()
    assert workspace == tmp_path / "dltraining" / "workspace"
    assert (workspace / "VERSION").read_text() == "1"
    inode = (workspace / ".git").stat().st_ino
    assert make_supervisor(tmp_path, config=config).workspace.prepare_code() == workspace  # rerun: kept as is
    assert (workspace / ".git").stat().st_ino == inode
    assert sup.run() is Outcome.COMPLETED
    assert events(tmp_path)[0][4] == str(workspace)

    config["training"]["code"]["ref"] = v2  # a new pinned commit: fetched and switched
    make_supervisor(tmp_path, config=config).workspace.prepare_code()
    assert (workspace / "VERSION").read_text() == "2"

    config["training"]["code"]["ref"] = "no-such-tag"
    with pytest.raises(ConfigError, match="training.code.ref: 'no-such-tag' cannot be checked out"):
        make_supervisor(tmp_path, config=config).workspace.prepare_code()
    assert (workspace / "VERSION").read_text() == "2"  # the failed switch lost nothing


def test_git_clone_needs_the_volume_mounted(tmp_path):
    config = base_config(tmp_path, code={"type": "git", "url": str(tmp_path / "repo"), "ref": "v1"})
    with pytest.raises(VolumeNotMountedError):
        make_supervisor(tmp_path, config=config, is_mounted=lambda: False).workspace.prepare_code()
    assert not (tmp_path / "dltraining" / "workspace").exists()


@pytest.mark.integration
def test_agent_sigterm_reaches_grandchildren_in_the_group(tmp_path):
    """A shell wrapper around the trainer: SIGTERM goes to the whole process group."""
    config = base_config(tmp_path)
    config["training"]["command"] = ["/bin/sh", "-c", "{python} trainer.py; echo wrapper-done >> "
                                     + str(tmp_path / "dltraining" / "checkpoints" / "events.log")]
    sup = make_supervisor(tmp_path, config=config)
    thread = threading.Thread(target=sup.run)
    thread.start()
    deadline = time.monotonic() + 20
    while not events(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    status = sup.terminate(timeout_s=20, reason="test")
    thread.join(timeout=20)
    assert status == -signal.SIGTERM  # the shell itself died of it ...
    while "sigterm-checkpoint" not in [e[0] for e in events(tmp_path)] and time.monotonic() < deadline:
        time.sleep(0.05)
    # ... and the Python trainer under it got it too, saved, and the wrapper's next command never ran.
    assert [e[0] for e in events(tmp_path)] == ["start", "sigterm-checkpoint"]


@pytest.mark.parametrize("program,reason", [("/nonexistent/python", "No such file or directory"),
                                            ("not-executable", "Permission denied"),
                                            ("garbage", "Exec format error")])
@pytest.mark.integration
def test_a_command_that_cannot_run_is_a_config_error(tmp_path, program, reason):
    if program != "/nonexistent/python":
        path = tmp_path / program
        path.write_text("not a program")
        path.chmod(0o644 if program == "not-executable" else 0o755)
        program = str(path)
    config = base_config(tmp_path)
    config["training"]["command"] = [program, "trainer.py"]
    with pytest.raises(ConfigError, match=rf"training.command\[0\]: '{program}' cannot be run \({reason}\)"):
        make_supervisor(tmp_path, config=config).run()


@pytest.mark.integration
def test_process_group_kill_reaches_children_in_sessions_of_their_own(tmp_path):
    """torchrun starts each rank with start_new_session: SIGKILL of its group misses them, and once it
    dies they are reparented, so ProcessGroup.kill must list the descendants before any signal."""
    pid_file = tmp_path / "child.pid"
    parent = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(300)\n")
    group = ProcessGroup.start([sys.executable, "-c", parent], cwd=tmp_path, env=os.environ)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the parent never started its child"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert group.kill_and_wait() == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _alive(child):
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            pytest.fail(f"the child {child} in a session of its own outlived ProcessGroup.kill")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's zombie is init's to reap)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.integration
def test_a_script_outside_the_asset_can_import_the_training_package(tmp_path):
    """Code cloned from git or copied from S3 lives outside the asset: the trainer's PYTHONPATH starts
    with the asset's directory (the one holding spot_training/), and keeps the node's own entries."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import spot_training

    sup = make_supervisor(tmp_path)
    sup.workspace.environ = {**sup.workspace.environ, "PYTHONPATH": "/opt/site"}
    path = sup.workspace.trainer_environment()["PYTHONPATH"].split(os.pathsep)
    assert path == [str(Path(spot_training.__file__).resolve().parents[1]), "/opt/site"]
    elsewhere = tmp_path / "cloned"
    elsewhere.mkdir()
    (elsewhere / "my_train.py").write_text("import spot_training.training, sys; print(spot_training.training.__name__)\n")
    env = {"PYTHONPATH": sup.workspace.trainer_environment()["PYTHONPATH"], "PATH": os.environ.get("PATH", "")}
    done = subprocess.run([sys.executable, "-S", "my_train.py"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "spot_training.training", done.stderr


# A trainer with worker processes in its group (a multiprocessing pool and a subprocess, as DataLoader
# workers are): on SIGTERM it checks that they are all still alive, saves and exits 0.
POOL_TRAINER = r'''
import multiprocessing, os, signal, subprocess, sys, time
from pathlib import Path

ckpt = Path(os.environ["SPOT_TRAINING_CHECKPOINT_DIR"])
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
if __name__ == "__main__":
    pool = multiprocessing.get_context("fork").Pool(2)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    workers = list(pool._pool)
    (ckpt / "ready").write_text("")
    while not stop:
        pool.apply(abs, (-1,))
        time.sleep(0.02)
    alive = child.poll() is None and all(w.is_alive() for w in workers)
    (ckpt / "saved").write_text("workers-alive" if alive else "workers-died")
    child.kill()
    pool.terminate()
    sys.exit(0 if alive else 1)
'''


@pytest.mark.integration
def test_a_notice_reaches_only_the_trainers_leader_and_its_workers_survive_until_it_saved(tmp_path):
    config = base_config(tmp_path)
    (tmp_path / "code" / "trainer.py").write_text(POOL_TRAINER)
    sup = make_supervisor(tmp_path, config=config)
    thread = threading.Thread(target=sup.run)
    thread.start()
    ckpt = tmp_path / "dltraining" / "checkpoints"
    deadline = time.monotonic() + 30
    while not (ckpt / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (ckpt / "ready").exists()
    status = sup.terminate(timeout_s=20, reason="spot-interruption")
    thread.join(timeout=20)
    assert (ckpt / "saved").read_text() == "workers-alive"
    assert status == 0 and sup.last_status == 0


@pytest.mark.integration
def test_a_trainer_that_ignores_sigterm_is_killed_with_its_group_at_the_deadline(tmp_path):
    config = base_config(tmp_path)
    ckpt = tmp_path / "dltraining" / "checkpoints"
    (tmp_path / "code" / "trainer.py").write_text(
        "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(ckpt / 'ready')!r}, 'w').close()\ntime.sleep(60)\n")
    sup = make_supervisor(tmp_path, config=config)
    thread = threading.Thread(target=sup.run)
    thread.start()
    deadline = time.monotonic() + 20
    while not (ckpt / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sup.terminate(timeout_s=1.0, reason="spot-interruption") == -signal.SIGKILL
    thread.join(timeout=20)
    assert not thread.is_alive()


@pytest.mark.integration
def test_trainer_exit_75_is_retried_without_counting_as_a_crash(tmp_path):
    """The restart policy's ``retry`` (75): the trainer stopped cleanly and asks to be run again; with
    ``max_restarts=0`` a crash would end supervision, a retry does not."""
    config = base_config(tmp_path)
    ckpt = tmp_path / "dltraining" / "checkpoints"
    (tmp_path / "code" / "trainer.py").write_text(
        "import sys\nfrom pathlib import Path\n"
        f"ckpt = Path({str(ckpt)!r})\n"
        "if not (ckpt / 'retried').exists():\n    (ckpt / 'retried').write_text('')\n    sys.exit(75)\n"
        "(ckpt / 'COMPLETED').write_text('{}')\n")
    sup = make_supervisor(tmp_path, config=config, max_restarts=0)
    assert sup.run() is Outcome.COMPLETED
    assert sup.starts == 2
