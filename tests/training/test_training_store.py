"""CheckpointStore and BackgroundSaver against a real file system (stdlib only, no framework)."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from spot_training.training.store import (
    BackgroundSaver,
    CheckpointPathError,
    CheckpointStore,
    FrameworkMismatchError,
)

REPO = Path(__file__).resolve().parents[2]


def writer(payload: bytes, name: str = "weights.bin"):
    def write(tmp: Path) -> None:
        (tmp / name).write_bytes(payload)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "opt.bin").write_bytes(payload[::-1])
    return write


def test_save_then_restore_round_trips_files_step_epoch_and_metadata(tmp_path):
    store = CheckpointStore(tmp_path / "ck", framework="tensorflow", framework_version="2.17.1")
    ckpt = store.save(writer(b"abc" * 100), step=50, epoch=1, metadata={"position": 7})
    assert ckpt.path == tmp_path / "ck" / "ckpt-000000000050"
    seen = []
    restored = store.restore(lambda c: seen.append((c.path / "weights.bin").read_bytes()))
    assert seen == [b"abc" * 100]
    assert (restored.step, restored.epoch, restored.framework) == (50, 1, "tensorflow")
    assert restored.metadata == {"position": 7}
    manifest = json.loads((ckpt.path / "manifest.json").read_text())
    assert manifest["framework_version"] == "2.17.1"
    assert set(manifest["files"]) == {"weights.bin", "sub/opt.bin"}
    assert len(manifest["checksum"]) == 64 and manifest["wall_time"] > 0
    latest = json.loads((tmp_path / "ck" / "LATEST").read_text())
    assert latest["checkpoint"] == "ckpt-000000000050" and latest["step"] == 50


def test_restore_of_empty_directory_returns_none_without_calling_read(tmp_path):
    store = CheckpointStore(tmp_path, framework="mxnet")
    assert store.restore(lambda c: pytest.fail("read called")) is None
    assert store.latest() is None and store.checkpoints() == []


def test_keeps_the_newest_n_and_updates_latest_first(tmp_path):
    store = CheckpointStore(tmp_path, framework="tensorflow", keep=3)
    for step in range(10, 70, 10):
        store.save(writer(bytes([step])), step=step, epoch=0)
    assert [c.step for c in store.checkpoints()] == [60, 50, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "LATEST", "ckpt-000000000040", "ckpt-000000000050", "ckpt-000000000060"]


def test_newest_corrupted_falls_back_to_previous_and_logs_it(tmp_path, caplog):
    store = CheckpointStore(tmp_path, framework="tensorflow")
    store.save(writer(b"old"), step=10, epoch=0)
    newest = store.save(writer(b"new"), step=20, epoch=0)
    (newest.path / "weights.bin").write_bytes(b"NEW")  # same size, flipped bytes
    with caplog.at_level(logging.WARNING, logger="spot_training.training.store"):
        ckpt = store.restore(lambda c: None)
    assert ckpt.step == 10
    assert str(newest.path) in caplog.text and "sha256" in caplog.text
    assert newest.path.exists(), "a corrupt checkpoint is reported, never deleted on restore"


def test_torn_checkpoint_without_manifest_or_with_missing_file_is_skipped(tmp_path, caplog):
    store = CheckpointStore(tmp_path, framework="tensorflow")
    store.save(writer(b"good"), step=10, epoch=0)
    torn = store.save(writer(b"torn"), step=20, epoch=0)
    (torn.path / "sub" / "opt.bin").unlink()
    no_manifest = tmp_path / "ckpt-000000000030"
    no_manifest.mkdir()
    (no_manifest / "weights.bin").write_bytes(b"half")
    with caplog.at_level(logging.WARNING, logger="spot_training.training.store"):
        assert store.latest().step == 10
    assert "missing file" in caplog.text and "manifest.json is missing" in caplog.text


def test_a_new_save_never_prunes_a_good_checkpoint_in_favour_of_a_torn_one(tmp_path):
    store = CheckpointStore(tmp_path, framework="tensorflow", keep=2)
    store.save(writer(b"a"), step=10, epoch=0)
    torn = store.save(writer(b"b"), step=20, epoch=0)
    (torn.path / "weights.bin").write_bytes(b"")  # truncated
    store.save(writer(b"c"), step=30, epoch=0)
    (tmp_path / "ckpt-000000000030" / "weights.bin").write_bytes(b"X")  # same size, wrong content
    # 30 is structurally fine (kept), 20 is torn (kept but not counted), 10 is the good fallback.
    assert store.latest().step == 10


def test_fails_when_checkpoint_path_is_a_file_and_leaves_it_alone(tmp_path):
    path = tmp_path / "checkpoints"
    path.write_text("not a directory")
    with pytest.raises(CheckpointPathError, match=str(path)) as info:
        CheckpointStore(path, framework="tensorflow")
    assert "not a directory" in str(info.value)
    assert path.read_text() == "not a directory"
    with pytest.raises(CheckpointPathError, match="parent path is a file"):
        CheckpointStore(path / "below", framework="tensorflow")


def test_fails_when_checkpoint_is_of_the_other_framework_and_deletes_nothing(tmp_path):
    CheckpointStore(tmp_path, framework="mxnet", framework_version="1.9.1").save(writer(b"m"), step=5, epoch=0)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    store = CheckpointStore(tmp_path, framework="tensorflow")
    with pytest.raises(FrameworkMismatchError, match="ckpt-000000000005") as info:
        store.restore(lambda c: pytest.fail("read called"))
    assert "'mxnet'" in str(info.value) and "'tensorflow'" in str(info.value)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("kwargs,match", [
    ({"keep": 1}, "keep must be an integer >= 2. Received: keep=1"),
    ({"keep": True}, "Received: keep=True"),
    ({"framework": "jax"}, "framework must be one of"),
])
def test_fails_on_bad_constructor_arguments(tmp_path, kwargs, match):
    args = {"framework": "tensorflow", **kwargs}
    with pytest.raises(ValueError, match=match):
        CheckpointStore(tmp_path, **args)


def test_fails_on_bad_step_and_unserialisable_metadata(tmp_path):
    store = CheckpointStore(tmp_path, framework="tensorflow")
    with pytest.raises(ValueError, match="Received: step=-1"):
        store.save(writer(b"x"), step=-1, epoch=0)
    with pytest.raises(ValueError, match="metadata must be JSON-serialisable"):
        store.save(writer(b"x"), step=1, epoch=0, metadata={"x": object()})
    assert list(tmp_path.iterdir()) == []


def test_a_failing_write_leaves_previous_checkpoints_and_no_temp(tmp_path):
    store = CheckpointStore(tmp_path, framework="tensorflow")
    store.save(writer(b"ok"), step=1, epoch=0)

    def broken(tmp: Path) -> None:
        (tmp / "half").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.save(broken, step=2, epoch=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "ckpt-000000000001"]
    assert store.latest().step == 1


def test_saving_an_existing_step_again_keeps_the_verified_one(tmp_path):
    store = CheckpointStore(tmp_path, framework="tensorflow")
    first = store.save(writer(b"first"), step=7, epoch=0)
    again = store.save(writer(b"second"), step=7, epoch=0)
    assert again.path == first.path and (first.path / "weights.bin").read_bytes() == b"first"


def test_mark_complete_writes_the_contract_json(tmp_path):
    store = CheckpointStore(tmp_path, framework="mxnet")
    assert not store.is_complete()
    store.mark_complete(step=300, epoch=3)
    data = json.loads((tmp_path / "COMPLETED").read_text())
    assert data["step"] == 300 and data["epoch"] == 3 and data["wall_time"] > 0
    assert store.is_complete()


def test_background_saver_never_runs_two_writes_at_once_and_keeps_order(tmp_path):
    store = CheckpointStore(tmp_path, framework="tensorflow", keep=10)
    active, overlaps, order = [0], [], []
    lock = threading.Lock()

    def slow_writer(step):
        def write(tmp: Path) -> None:
            with lock:
                active[0] += 1
                overlaps.append(active[0])
            time.sleep(0.02)
            (tmp / "w").write_bytes(str(step).encode())
            order.append(step)
            with lock:
                active[0] -= 1
        return write

    saver = BackgroundSaver(store)
    for step in range(1, 7):
        saver.submit(slow_writer(step), step=step, epoch=0)
    last = saver.close()
    assert max(overlaps) == 1
    assert order == [1, 2, 3, 4, 5, 6]
    assert last.step == 6 and store.latest().step == 6


def test_background_saver_reraises_a_write_error_on_the_training_thread(tmp_path):
    saver = BackgroundSaver(CheckpointStore(tmp_path, framework="tensorflow"))

    def broken(tmp: Path) -> None:
        raise OSError("no space left on device")

    saver.submit(broken, step=1, epoch=0)
    with pytest.raises(OSError, match="no space left"):
        saver.wait()
    saver.submit(writer(b"ok"), step=2, epoch=0)
    assert saver.close().step == 2


TORTURE_WRITER = textwrap.dedent("""
    import os, sys
    from spot_training.training.store import CheckpointStore
    store = CheckpointStore(sys.argv[1], framework="tensorflow", keep=2)
    last = store.latest()
    step = last.step if last else 0
    print("ready", flush=True)
    while True:
        step += 1
        blob = os.urandom(1 << 20)
        def write(tmp, blob=blob):
            for i in range(4):
                (tmp / f"shard-{i}.bin").write_bytes(blob)
        store.save(write, step=step, epoch=step // 100)
""")


@pytest.mark.integration
def test_torture_sigkill_during_checkpoint_writes_always_leaves_a_valid_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    script = tmp_path / "writer.py"
    script.write_text(TORTURE_WRITER)
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    kills, steps = 0, []
    for _ in range(25):
        proc = subprocess.Popen([sys.executable, str(script), str(ck)], env=env,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.05, 0.4))  # lands inside a save almost always: the loop only saves
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL
        kills += 1
        store = CheckpointStore(ck, framework="tensorflow", keep=2)  # removes temps of the killed writer
        latest = store.latest()  # verifies sha256 of every file
        if steps:
            assert latest is not None, f"no valid checkpoint after kill {kills}"
        if latest is not None:
            assert steps == [] or latest.step >= steps[-1], "progress went backwards"
            steps.append(latest.step)
        assert not [p for p in ck.iterdir() if p.name.startswith(".tmp-")]
    assert kills >= 20
    assert len(steps) >= 20 and steps[-1] > steps[0]


def test_background_writer_thread_runs_at_lower_priority_than_training(tmp_path):
    seen = {}
    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def write(tmp: Path) -> None:
        seen["writer"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        (tmp / "w").write_bytes(b"x")

    saver = BackgroundSaver(CheckpointStore(tmp_path, framework="tensorflow"), writer_nice=10)
    saver.submit(write, step=1, epoch=0)
    saver.close()
    assert seen["writer"] >= max(10, main_before)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before, "only the writer is lowered"
    with pytest.raises(ValueError, match="Received: writer_nice=25"):
        BackgroundSaver(CheckpointStore(tmp_path, framework="tensorflow"), writer_nice=25)


def test_two_phase_save_commits_what_another_writer_put_in_the_temp_dir(tmp_path):
    store = CheckpointStore(tmp_path, framework="tensorflow")
    saver = BackgroundSaver(store)
    tmp = store.begin(5)
    assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-ckpt-000000000005")

    def finish() -> None:  # stands in for tf.train.Checkpoint.sync(): the async write lands now
        (tmp / "tf_ckpt.index").write_bytes(b"index")

    saver.submit_prepared(tmp, finish, step=5, epoch=0)
    ckpt = saver.close()
    assert ckpt.step == 5 and set(ckpt.manifest["files"]) == {"tf_ckpt.index"}
    assert not tmp.exists() and store.latest().step == 5


def test_write_file_entries_match_the_bytes_on_disk_and_cover_every_file(tmp_path):
    import hashlib

    from spot_training.training.store import write_file

    payload = bytes(range(256)) * 5000  # over hashlib's 2 KiB GIL-release threshold
    store = CheckpointStore(tmp_path / "ck", framework="tensorflow")

    def write(tmp: Path) -> dict:
        entries = {"big.bin": write_file(tmp / "big.bin", [b"head", memoryview(payload)])}
        (tmp / "plain.bin").write_bytes(b"not listed")  # the store must hash this one itself
        # A listed entry whose size disagrees with the file is not trusted: the store re-hashes it.
        (tmp / "lied.bin").write_bytes(b"12345")
        entries["lied.bin"] = {"size": 4, "sha256": "0" * 64}
        return entries

    ckpt = store.save(write, step=3, epoch=0)
    files = ckpt.manifest["files"]
    assert sorted(files) == ["big.bin", "lied.bin", "plain.bin"]
    for rel, entry in files.items():
        data = (ckpt.path / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert files["big.bin"]["size"] == 4 + len(payload)
    assert store.latest().step == 3
    with pytest.raises(FileExistsError):
        write_file(ckpt.path / "big.bin", [b"x"])  # a checkpoint file is written once, never overwritten
    # A byte flipped on disk after the write is caught on restore (the digest is of what was written).
    big = ckpt.path / "big.bin"
    data = bytearray(big.read_bytes())
    data[100_000] ^= 1
    big.write_bytes(bytes(data))
    assert store.latest() is None


@pytest.mark.integration
def test_a_new_store_removes_only_temporaries_whose_writer_is_gone(tmp_path):
    """A checkpoint directory on EFS is shared by every node of a cluster: opening a store (every rank
    does) must not delete a temporary directory a live writer is filling, on this host or another one;
    what a dead writer of this host left goes at once, an unowned or foreign one once it is stale."""
    import socket

    from spot_training.training.store import STALE_TEMP_AGE_S

    host = socket.gethostname().replace("-", "_")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead_here": f".tmp-ckpt-000000000010-{host}-{dead_pid}-0123abcd",
            "live_here": f".tmp-ckpt-000000000020-{host}-{live.pid}-0123abcd",
            "other_host_fresh": f".tmp-ckpt-000000000030-ip_10_0_0_7-4242-0123abcd",
            "other_host_old": f".tmp-ckpt-000000000040-ip_10_0_0_8-4242-0123abcd",
            "probe_fresh": ".tmp-probe-x1y2z3",
        }
        for name in names.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "weights.bin").write_bytes(b"w")
        old = time.time() - STALE_TEMP_AGE_S - 60
        for path in [tmp_path / names["other_host_old"], tmp_path / names["other_host_old"] / "weights.bin"]:
            os.utime(path, (old, old))
        CheckpointStore(tmp_path, framework="tensorflow")
        left = {key for key, name in names.items() if (tmp_path / name).exists()}
        assert left == {"live_here", "other_host_fresh", "probe_fresh"}
    finally:
        live.kill()
        live.wait()
