"""TorchAdapter and StepSampler in-process (CPU): round trip of every captured piece, reused host
buffers, checks before changes, compiled/plain key space, the batch sampler's data position."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from spot_training.training.core import CheckpointDriver
from spot_training.training.datasets import batch_indices
from spot_training.training.notice import NoticeHandler
from spot_training.training.store import ShapeMismatchError
from spot_training.training.torch_adapter import INDEX_FILE, StepSampler, TorchAdapter, TorchCheckpointer, unwrap_module

pytestmark = pytest.mark.torch


def _quiet() -> NoticeHandler:
    return NoticeHandler(request_file=None, stop_signals=(), checkpoint_signals=())


class Counter:
    """An extra object with state_dict/load_state_dict holding a tensor and Python values."""

    def __init__(self) -> None:
        self.seen, self.hist = 0, torch.zeros(4)

    def state_dict(self):
        return {"seen": self.seen, "hist": self.hist, "tuple": (1, 2.5)}

    def load_state_dict(self, state):
        self.seen, self.hist = state["seen"], state["hist"].clone()
        assert state["tuple"] == (1, 2.5)


def _objects(width: int = 6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.BatchNorm1d(width), torch.nn.Dropout(0.3),
                                torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    return model, opt, sched, scaler, Counter()


def _train(model, opt, sched, scaler, counter, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(8, 4)
        loss = model(x).square().mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        counter.seen += 1
        counter.hist += torch.rand(4)


def _state(model, opt, sched, scaler, counter) -> dict:
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, slots in opt.state_dict()["state"].items():
        out.update({f"o.{pid}.{k}": v.clone() for k, v in slots.items()})
    out["lr"] = torch.tensor(sched.get_last_lr())
    out["scale"] = torch.tensor(scaler.get_scale())
    out["hist"] = counter.hist.clone()
    out["seen"] = torch.tensor(counter.seen)
    return out


@pytest.mark.parametrize("background", [True, False])
def test_round_trip_restores_every_piece_bitwise(tmp_path: Path, background: bool) -> None:
    objs = _objects()
    driver = CheckpointDriver(TorchAdapter(*objs[:3], scaler=objs[3], extra={"counter": objs[4]}),
                              checkpoint_dir=tmp_path, every_steps=None, background=background, notices=_quiet())
    _train(*objs, steps=5)
    driver.step = 5
    driver.save(wait=True)
    expected = _state(*objs)
    _train(*objs, steps=3)
    after_save = (_state(*objs), torch.get_rng_state())
    driver.close()

    fresh = _objects()
    torch.manual_seed(123)
    driver2 = CheckpointDriver(TorchAdapter(*fresh[:3], scaler=fresh[3], extra={"counter": fresh[4]}),
                               checkpoint_dir=tmp_path, notices=_quiet())
    assert driver2.restore() == 5
    got = _state(*fresh)
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    # The generators are back too: the next 3 steps replay exactly.
    _train(*fresh, steps=3)
    for key, value in after_save[0].items():
        assert torch.equal(_state(*fresh)[key], value), key
    assert torch.equal(torch.get_rng_state(), after_save[1])
    driver2.close()


def test_host_buffers_are_reused_between_saves(tmp_path: Path) -> None:
    objs = _objects()
    adapter = TorchAdapter(*objs[:3])
    driver = CheckpointDriver(adapter, checkpoint_dir=tmp_path, every_steps=None, notices=_quiet())
    _train(*objs, steps=2)
    driver.step = 2
    driver.save(wait=True)
    pointers = {k: t.data_ptr() for k, t in adapter._host.items()}
    _train(*objs, steps=2)
    driver.step = 4
    driver.save(wait=True)
    assert {k: t.data_ptr() for k, t in adapter._host.items()} == pointers
    driver.close()


def test_changed_model_is_refused_before_anything_changes(tmp_path: Path) -> None:
    objs = _objects()
    driver = CheckpointDriver(TorchAdapter(*objs[:3]), checkpoint_dir=tmp_path, notices=_quiet())
    _train(*objs, steps=2)
    driver.step = 2
    driver.save(wait=True)
    driver.close()
    other = _objects(width=7)
    before = {k: v.clone() for k, v in other[0].state_dict().items()}
    driver2 = CheckpointDriver(TorchAdapter(*other[:3]), checkpoint_dir=tmp_path, notices=_quiet())
    with pytest.raises(ShapeMismatchError, match=r"ckpt-000000000002.*'0\.weight'"):
        driver2.restore()
    assert all(torch.equal(before[k], v) for k, v in other[0].state_dict().items())
    assert other[2].last_epoch == 0  # the scheduler was not touched either


def test_compiled_model_keys_have_no_wrapper_prefix(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    compiled = torch.compile(model, backend="eager")
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    assert unwrap_module(compiled) is model
    ckpt = TorchCheckpointer(compiled, checkpoint_dir=tmp_path, every_steps=None, notices=_quiet())
    for _ in ckpt.steps(1):
        pass
    index = json.loads((ckpt.driver.store.latest().path / INDEX_FILE).read_text())
    assert sorted(e["key"] for e in index["tensors"] if e["key"].startswith("model/")) == ["model/bias", "model/weight"]


def test_bad_snapshot_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="snapshot_mode.*'fast'"):
        TorchAdapter(torch.nn.Linear(1, 1), snapshot_mode="fast")


def test_step_sampler_shards_the_global_batch_by_rank() -> None:
    n, bs, seed = 100, 8, 5
    ranks = [StepSampler(n, bs, seed=seed, rank=r, world_size=2, start=3, total_steps=6) for r in range(2)]
    batches = [list(s) for s in ranks]
    assert len(batches[0]) == len(ranks[0]) == 3
    for i, step in enumerate(range(3, 6)):
        assert batches[0][i] + batches[1][i] == batch_indices(step, batch_size=2 * bs, n=n, seed=seed).tolist()
    with pytest.raises(ValueError, match="rank"):
        StepSampler(n, bs, rank=2, world_size=2)


def test_loader_starts_at_the_restored_step_and_does_not_shift_the_generator(tmp_path: Path) -> None:
    data = torch.arange(40.0)[:, None]
    dataset = torch.utils.data.TensorDataset(data)
    model = torch.nn.Linear(1, 1)
    seen = {}
    for run in range(2):
        ckpt = TorchCheckpointer(model, checkpoint_dir=tmp_path, every_steps=3, background=False, notices=_quiet())
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=ckpt.batch_sampler(40, 4, seed=1))
        for step, (x,) in ckpt.steps(4 if run == 0 else 8, loader):
            seen[step] = (x[:, 0].long().tolist(), torch.rand(1).item())
    assert sorted(seen) == list(range(8))
    for step in range(8):
        assert seen[step][0] == batch_indices(step, batch_size=4, n=40, seed=1).tolist()


def test_starting_the_loader_does_not_draw_from_torchs_generator(tmp_path: Path) -> None:
    """A DataLoader draws its base seed from torch's generator when iteration starts; a resumed run
    starts it at another step than an uninterrupted one, so steps() hides that draw."""
    dataset = torch.utils.data.TensorDataset(torch.arange(40.0)[:, None])
    ckpt = TorchCheckpointer(torch.nn.Linear(1, 1), checkpoint_dir=tmp_path, every_steps=None, notices=_quiet())
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=ckpt.batch_sampler(40, 4))
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    for _step, _batch in ckpt.steps(1, loader):
        assert torch.equal(torch.rand(3), expected)


@pytest.mark.integration
def test_gpu_benchmark_without_a_gpu_says_so_and_exits_0() -> None:
    import subprocess
    import sys

    import os

    repo = Path(__file__).resolve().parents[2]
    # CUDA hidden from the child, so the no-GPU path is what runs on any machine.
    proc = subprocess.run([sys.executable, str(repo / "bench" / "bench_checkpoint_gpu.py"), "--params", "1e6",
                           "--width", "256"], capture_output=True, text=True, timeout=120, cwd=repo,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "no CUDA device found" in lines[0]
    assert json.loads(lines[-1])["cuda"] is False


def test_a_loader_that_runs_out_is_named_clearly(tmp_path: Path) -> None:
    dataset = torch.utils.data.TensorDataset(torch.arange(8.0)[:, None])
    ckpt = TorchCheckpointer(torch.nn.Linear(1, 1), checkpoint_dir=tmp_path, every_steps=None, notices=_quiet())
    with pytest.raises(ValueError, match="ran out of batches at step 2 of total_steps=5.*batch_sampler"):
        for _ in ckpt.steps(5, torch.utils.data.DataLoader(dataset, batch_size=4)):
            pass


def test_a_torchrun_launch_without_a_process_group_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2.*init_process_group"):
        TorchAdapter(torch.nn.Linear(1, 1))


class _Payload:
    """Pickles to a call that creates ``marker``: what an attacker plants in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_planted_pickle_payload_never_runs_and_the_checkpoint_is_refused(tmp_path: Path) -> None:
    import base64
    import pickle

    from spot_training.training import store as store_module
    from spot_training.training.store import MANIFEST_NAME, CheckpointError

    objs = _objects()
    driver = CheckpointDriver(TorchAdapter(*objs[:3]), checkpoint_dir=tmp_path / "ckpt", notices=_quiet())
    _train(*objs, steps=1)
    driver.step = 1
    ckpt = driver.save(wait=True)
    driver.close()
    marker = tmp_path / "pwned"
    index = json.loads((ckpt.path / INDEX_FILE).read_text())
    index["state"]["optimizer"]["param_groups"][0]["lr"] = {
        "__pickle__": base64.b64encode(pickle.dumps(_Payload(marker))).decode()}
    (ckpt.path / INDEX_FILE).write_text(json.dumps(index))
    # Whoever can write the directory can also make the manifest's checksums match.
    manifest = json.loads((ckpt.path / MANIFEST_NAME).read_text())
    for rel, entry in manifest["files"].items():
        entry.update(size=(ckpt.path / rel).stat().st_size, sha256=store_module._file_sha256(ckpt.path / rel))
    manifest["checksum"] = store_module._combined_checksum(manifest["files"])
    (ckpt.path / MANIFEST_NAME).write_text(json.dumps(manifest))

    fresh = _objects()
    before = {k: v.clone() for k, v in fresh[0].state_dict().items()}
    driver2 = CheckpointDriver(TorchAdapter(*fresh[:3]), checkpoint_dir=tmp_path / "ckpt", notices=_quiet())
    with pytest.raises(CheckpointError, match=r"index\.json.*param_groups/0/lr.*__pickle__.*refusing"):
        driver2.restore()
    assert not marker.exists(), "the checkpoint ran code on restore"
    assert all(torch.equal(before[k], v) for k, v in fresh[0].state_dict().items())


def test_state_that_is_not_data_is_refused_at_save_naming_the_entry(tmp_path: Path) -> None:
    class Holder:
        def state_dict(self):
            return {"fn": print}

        def load_state_dict(self, state):
            pass

    model = torch.nn.Linear(2, 2)
    driver = CheckpointDriver(TorchAdapter(model, extra={"holder": Holder()}), checkpoint_dir=tmp_path,
                              notices=_quiet(), background=False)
    driver.step = 1
    with pytest.raises(ValueError, match=r"'extra.holder/fn'.*builtin_function_or_method.*checkpoints are data"):
        driver.save()
    driver.close()


class _NoisyDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]) + torch.rand(1)


@pytest.mark.integration
@pytest.mark.parametrize(("noisy", "workers"), [(True, 2), (False, 2), (True, 0)])
def test_worker_side_randomness_warns_once_that_resume_is_not_exact(tmp_path: Path, caplog, noisy, workers) -> None:
    dataset = _NoisyDataset() if noisy else torch.utils.data.TensorDataset(torch.arange(16.0)[:, None])
    ckpt = TorchCheckpointer(torch.nn.Linear(1, 1), checkpoint_dir=tmp_path, every_steps=None, background=False,
                             notices=_quiet())
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=ckpt.batch_sampler(16, 4), num_workers=workers)
    state = torch.get_rng_state()
    with caplog.at_level("WARNING"):
        for _ in ckpt.steps(3, loader):
            pass
    warned = [r for r in caplog.records if "resume is not exact" in r.getMessage()]
    assert len(warned) == (1 if noisy and workers else 0)
    if warned:
        assert "torch generator" in warned[0].getMessage() and "docs/training-pytorch.md" in warned[0].getMessage()
    if workers:  # the probe drew nothing for good (without workers the dataset draws in this process)
        assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("background", [True, False])
def test_a_full_disk_exits_74_without_the_script_mapping_it(tmp_path: Path, monkeypatch, background: bool) -> None:
    import errno

    from spot_training.training import torch_adapter

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch_adapter, "write_file", full)
    ckpt = TorchCheckpointer(torch.nn.Linear(2, 2), checkpoint_dir=tmp_path, every_steps=2, background=background,
                             notices=_quiet())
    with pytest.raises(SystemExit) as exited:
        for _ in ckpt.steps(6):
            pass
    assert exited.value.code == 74
    assert not list(tmp_path.glob("ckpt-*"))  # nothing half-written was committed
