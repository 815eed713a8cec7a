"""spot_training.training.distributed.lr and .common: learning-rate scaling with warm-up, global batches and shards."""

from __future__ import annotations

import os

import numpy as np
import pytest

from spot_training.training.distributed import common
from spot_training.training.distributed.common import global_batch, worker_shard
from spot_training.training.distributed.lr import scaled_learning_rate


def test_linear_scaling_ramps_from_base_to_workers_times_base():
    rates = [scaled_learning_rate(0.1, num_workers=4, step=s, warmup_steps=4) for s in range(6)]
    assert rates == pytest.approx([0.175, 0.25, 0.325, 0.4, 0.4, 0.4])
    assert scaled_learning_rate(0.1, num_workers=1, step=0, warmup_steps=10) == pytest.approx(0.1)
    # warm-up restarts where a generation changed the worker count
    assert scaled_learning_rate(0.1, num_workers=2, step=100, warmup_steps=10, warmup_start_step=100) == \
        pytest.approx(0.11)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_workers": 0}, "num_workers must be an integer >= 1. Received: num_workers=0"),
    ({"num_workers": True}, "num_workers must be an integer >= 1. Received: num_workers=True"),
    ({"step": -1}, "step must be an integer >= 0. Received: step=-1"),
])
def test_fails_when_scaling_arguments_are_bad(kwargs, message):
    args = {"num_workers": 2, "step": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        scaled_learning_rate(0.1, **args)
    with pytest.raises(ValueError, match="base_lr must be > 0"):
        scaled_learning_rate(0.0, num_workers=1, step=0)


def test_shards_cover_the_global_batch_exactly_once_for_any_worker_count():
    batch = global_batch(7, batch_size=64, n=1437, seed=0)
    for workers in (1, 2, 3):
        shards = [worker_shard(batch, rank=r, num_workers=workers) for r in range(workers)]
        assert np.array_equal(np.concatenate(shards), batch)
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(ValueError, match="rank must be in 0..num_workers-1, got rank=3, num_workers=3"):
        worker_shard(batch, rank=3, num_workers=3)


def test_rank_zero_also_writes_the_progress_the_agent_publishes(tmp_path, monkeypatch):
    """docs/contracts.md: the node agent publishes <log_dir>/training_log.csv and progress.json; in a
    cluster rank 0 writes them (whichever node holds rank 0), every process still its own steps file."""
    import csv
    import json

    from spot_training.training.distributed.common import StepLog

    monkeypatch.setenv("SPOT_TRAINING_NODE_ID", "node-b")
    worker = StepLog(tmp_path, steps_total=800)
    worker.write(step=1, rank=1, num_workers=2, loss=0.5, learning_rate=0.1)
    worker.close()
    assert not (tmp_path / "training_log.csv").exists() and not (tmp_path / "progress.json").exists()
    monkeypatch.setenv("SPOT_TRAINING_NODE_ID", "node-a")
    chief = StepLog(tmp_path, steps_total=800)
    for step in (1, 2):
        chief.write(step=step, rank=0, num_workers=2, loss=1.0 / step, learning_rate=0.1)
    chief.close()
    rows = list(csv.DictReader(open(tmp_path / "training_log.csv")))
    assert [(r["step"], r["loss"], r["num_workers"]) for r in rows] == [("1", "1.000000", "2"), ("2", "0.500000", "2")]
    assert all(float(r["wall_time"]) > 1.7e9 for r in rows)
    assert json.loads((tmp_path / "progress.json").read_text()) == {"steps_total": 800}
    assert (tmp_path / "steps-node-a.csv").exists() and (tmp_path / "steps-node-b.csv").exists()


def test_the_cluster_trainers_cadence_is_the_agents_environment_else_the_contracts(monkeypatch) -> None:
    # No cadence of their own: the node config's, exported by the agent, else the contract's one default.
    from spot_training import contract
    from spot_training.training.distributed.common import parse_args

    monkeypatch.delenv("SPOT_TRAINING_CHECKPOINT_EVERY_STEPS", raising=False)
    assert parse_args([], description="t").save_every_steps == contract.default("checkpoint_every_steps")
    monkeypatch.setenv("SPOT_TRAINING_CHECKPOINT_EVERY_STEPS", "7")
    assert parse_args([], description="t").save_every_steps == 7
    assert parse_args(["--save-every-steps", "3"], description="t").save_every_steps == 3
    monkeypatch.setenv("SPOT_TRAINING_CHECKPOINT_EVERY_STEPS", "0")
    with pytest.raises(SystemExit):
        parse_args([], description="t")


def test_node_id_names_the_instance_and_each_local_rank_when_a_node_runs_several(monkeypatch):
    # Every trainer process appends its own steps-<node_id>.csv: two torchrun ranks on one node
    # (--nproc-per-node 2) must not share a file, one process per node keeps the instance id alone.
    monkeypatch.setenv("SPOT_TRAINING_NODE_ID", "i-0abc")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert common.node_id() == "i-0abc"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert common.node_id() == "i-0abc"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert common.node_id() == "i-0abc-1"
    monkeypatch.delenv("SPOT_TRAINING_NODE_ID")
    assert common.node_id() == f"pid-{os.getpid()}-1"
