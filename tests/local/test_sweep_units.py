"""Sweeps without AWS: Batch's retry rules as LocalBatch applies them, the manifest, the child's checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spot_training import contract
from spot_training.agent.sweep_child import SweepChild, SweepConfigError, check_manifest, metrics_at, trainer_argv
from spot_training.infra.sweep import RETRY_RULES
from spot_training.local.batch import RetryRule, evaluate_on_exit, next_status
from spot_training.ops.sweep import best_table, parameter_sets

#: The stack's rules in the shape moto/Batch return them (describe_job_definitions).
DEPLOYED = [RetryRule.from_api({k: v for k, v in (("action", a.lower()), ("onStatusReason", s), ("onExitCode", e), ("onReason", r)) if v})
            for a, s, e, r in RETRY_RULES]
RECLAIMED = contract.BATCH_HOST_TERMINATED_REASON.format(instance_id="i-0123456789abcdef0")


@pytest.mark.parametrize("exit_code, status_reason, reason, expected", [
    (None, RECLAIMED, None, "RETRY"),                                    # host reclaimed: no exit code
    (contract.EXIT_SWEEP_RECLAIM_NOT_TAKEN, None, "Essential container in task exited", "RETRY"),
    (1, None, "Essential container in task exited", "EXIT"),             # a code error fails fast
    (2, None, "Essential container in task exited", "EXIT"),
    (137, "Job attempt duration exceeded timeout", None, "EXIT"),
])
def test_deployed_rules(exit_code, status_reason, reason, expected) -> None:
    assert evaluate_on_exit(DEPLOYED, exit_code=exit_code, status_reason=status_reason, reason=reason) == expected


def test_first_match_wins_and_no_match_retries() -> None:
    rules = [RetryRule("EXIT", on_exit_code="1"), RetryRule("RETRY", on_exit_code="*")]
    assert evaluate_on_exit(rules, exit_code=1, status_reason=None, reason=None) == "EXIT"
    assert evaluate_on_exit(rules, exit_code=3, status_reason=None, reason=None) == "RETRY"
    # Batch: when no rule matches, the job is retried.
    assert evaluate_on_exit([RetryRule("EXIT", on_exit_code="9")], exit_code=3, status_reason=None, reason=None) == "RETRY"
    # Every condition of a rule must match; an absent value matches only "*".
    both = [RetryRule("EXIT", on_status_reason="Host EC2*", on_exit_code="0")]
    assert evaluate_on_exit(both, exit_code=None, status_reason=RECLAIMED, reason=None) == "RETRY"


def test_next_status_counts_attempts() -> None:
    kwargs = dict(rules=DEPLOYED, exit_code=None, status_reason=RECLAIMED, reason=None)
    assert next_status(attempt=1, attempts=3, **kwargs) == "RUNNABLE"
    assert next_status(attempt=3, attempts=3, **kwargs) == "FAILED"
    assert next_status(attempt=1, attempts=3, rules=DEPLOYED, exit_code=0, status_reason=None, reason=None) == "SUCCEEDED"
    assert next_status(attempt=1, attempts=3, rules=DEPLOYED, exit_code=1, status_reason=None, reason="x") == "FAILED"


def test_grid_expands_in_key_order_over_base() -> None:
    sets = parameter_sets({"grid": {"lr": [0.1, 0.2], "l2": [0, 1]}, "base": {"steps": 10}})
    assert sets == [{"steps": 10, "lr": 0.1, "l2": 0}, {"steps": 10, "lr": 0.1, "l2": 1},
                    {"steps": 10, "lr": 0.2, "l2": 0}, {"steps": 10, "lr": 0.2, "l2": 1}]


@pytest.mark.parametrize("bad", [[], {"lr": 1}, [1], [{"lr": [1, 2]}], [{"bad name": 1}], {"grid": {"lr": []}}])
def test_bad_manifest_is_refused(bad) -> None:
    with pytest.raises(ValueError):
        parameter_sets(bad)
    if isinstance(bad, list):
        with pytest.raises(SweepConfigError):
            check_manifest(bad)


def test_trainer_argv_appends_options() -> None:
    assert trainer_argv(["train.py"], {"lr": 0.1, "amp": True, "wd": False, "tag": None, "name": "a b"}) == \
        ["train.py", "--lr", "0.1", "--amp", "--name", "a b"]


def _child_env(tmp_path: Path, attempt: int, index: int = 1) -> dict[str, str]:
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps([{"lr": 0.1}, {"lr": 0.2}]))
    return {contract.ENV_ROOT: str(tmp_path / "efs"), contract.ENV_SWEEP_ID: "s1", contract.ENV_SWEEP_MANIFEST_URI: str(manifest),
            contract.ENV_BATCH_ARRAY_INDEX: str(index), contract.ENV_BATCH_JOB_ATTEMPT: str(attempt)}


def test_child_takes_its_index_and_resumes_only_on_a_retry(tmp_path: Path) -> None:
    child = SweepChild(["python train.py"], environ=_child_env(tmp_path, 1))
    assert child.params == {"lr": 0.2} and child.command == ["python", "train.py"]
    assert child.dir == tmp_path / "efs" / contract.SWEEP_MOUNT_POINT.lstrip("/") / "s1" / "1"
    child.checkpoint_dir.mkdir(parents=True)
    (child.checkpoint_dir / contract.LATEST_FILE).write_text(json.dumps({"step": 20}))
    # Attempt 1 finding a committed checkpoint: an earlier run's folder; refused, nothing touched.
    with pytest.raises(SweepConfigError, match="earlier run"):
        SweepChild(["python train.py"], environ=_child_env(tmp_path, 1))
    assert SweepChild(["python train.py"], environ=_child_env(tmp_path, 2)).attempt == 2


@pytest.mark.parametrize("change, match", [({contract.ENV_BATCH_ARRAY_INDEX: "2"}, "2 parameter sets"),
                                           ({contract.ENV_BATCH_JOB_ATTEMPT: "0"}, "ATTEMPT"),
                                           ({contract.ENV_SWEEP_ID: "../x"}, "sweep id")])
def test_child_bad_environment(tmp_path: Path, change: dict[str, str], match: str) -> None:
    with pytest.raises(SweepConfigError, match=match):
        SweepChild(["train.py"], environ={**_child_env(tmp_path, 1), **change})


def test_metrics_at_takes_the_committed_steps_row(tmp_path: Path) -> None:
    log = tmp_path / "training_log.csv"
    log.write_text("step,epoch,loss,accuracy,wall_time\n1,0,2.0,0.1,1\n2,0,1.5,0.5,2\n2,0,1.4,0.6,3\n3,0,1.0,0")
    assert metrics_at(log, 2)["accuracy"] == 0.6 and metrics_at(log, 3) == {}


def test_best_table_ranks_by_metric() -> None:
    rows = [{"index": i, "accuracy": a, "step": 1, "total_steps": 2, "state": "RUNNING", "params": {}} for i, a in enumerate([0.5, None, 0.9, 0.9])]
    assert [b["index"] for b in best_table(rows)] == [2, 3, 0]


def test_sweep_commands_are_registered() -> None:
    from spot_training.cli import parse_args

    args = parse_args(["sweep", "status", "s1", "--json", "--metric", "loss"])
    assert (args.sweep_command, args.sweep_id, args.json, args.metric, args.stack) == ("status", "s1", True, "loss", "SpotSweep")
    args = parse_args(["sweep", "submit", "grid.yaml", "--command", "python train.py"])
    assert args.file == Path("grid.yaml") and args.command == "python train.py"
    assert parse_args(["local", "drill", "--sweep"]).sweep is True
