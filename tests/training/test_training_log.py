"""The trainers' progress files (spot_training/training/training_log.py) and the examples' shared flags
(``add_length_arguments``/``parse_trainer_arguments`` in spot_training/training/core.py), in-process."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import pytest

from spot_training.training import training_log
from spot_training.training.core import add_checkpoint_arguments, add_length_arguments, parse_trainer_arguments
from spot_training.training.training_log import EXAMPLE_LOG_FIELDS, TrainingLog, write_progress


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


def test_a_resumed_run_appends_below_one_header_and_each_row_is_on_disk_at_once(tmp_path: Path) -> None:
    log = TrainingLog(tmp_path / "logs", steps_total=90)
    log.write(1, 0, 2.5, 0.25)
    # Line-buffered: a SIGKILL right after write() loses nothing.
    assert _rows(log.path)[1][:4] == ["1", "0", "2.500000", "0.250000"]
    log.close()
    with TrainingLog(tmp_path / "logs", steps_total=90) as again:  # the restart
        again.write(2, 0, 2.0, 0.5)
    rows = _rows(tmp_path / "logs" / "training_log.csv")
    assert rows[0] == list(EXAMPLE_LOG_FIELDS) and [r[0] for r in rows[1:]] == ["1", "2"]
    assert json.loads((tmp_path / "logs" / "progress.json").read_text()) == {"steps_total": 90}


def test_an_empty_log_file_gets_its_header_and_no_total_writes_no_progress(tmp_path: Path) -> None:
    (tmp_path / "training_log.csv").write_text("")
    with TrainingLog(tmp_path) as log:
        log.write(1, 0, 1.0, 1.0)
    assert _rows(tmp_path / "training_log.csv")[0] == list(EXAMPLE_LOG_FIELDS)
    assert not (tmp_path / "progress.json").exists()


def test_the_log_dir_defaults_to_the_agents_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPOT_TRAINING_LOG_DIR", str(tmp_path / "from-env"))
    with TrainingLog(steps_total=3) as log:
        assert log.path == tmp_path / "from-env" / "training_log.csv"


def test_progress_is_written_through_the_contracts_atomic_writer(tmp_path: Path, monkeypatch) -> None:
    """The agent reads progress.json while the trainer writes it: never half a file (write_json_atomic)."""
    calls = []
    monkeypatch.setattr(training_log, "write_json_atomic", lambda path, payload: calls.append((path, payload)))
    write_progress(tmp_path, 12)
    assert calls == [(tmp_path / "progress.json", {"steps_total": 12})]


@pytest.mark.parametrize("bad", [0, -5, True, 1.5, "90"])
def test_a_bad_total_names_itself_and_writes_nothing(tmp_path: Path, bad) -> None:
    with pytest.raises(ValueError, match=rf"steps_total must be an integer >= 1 .*got {bad!r}"):
        TrainingLog(tmp_path, steps_total=bad)
    assert list(tmp_path.iterdir()) == []


def _parser(*, steps: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_length_arguments(parser, steps=steps)
    add_checkpoint_arguments(parser)
    parser.add_argument("--threads", type=int, default=1)
    return parser


def test_the_examples_length_flags_default_and_exclude_each_other(capsys) -> None:
    args = parse_trainer_arguments(_parser(), [], "threads")
    assert (args.steps, args.epochs, args.batch_size) == (None, 5, 32)
    assert parse_trainer_arguments(_parser(), ["--steps", "7"]).steps == 7
    with pytest.raises(SystemExit) as exit_info:
        parse_trainer_arguments(_parser(), ["--steps", "7", "--epochs", "2"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert not hasattr(parse_trainer_arguments(_parser(steps=False), []), "steps")


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--epochs", "-1"], "--epochs must be >= 1, got -1"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    # The store refuses fewer than 2; the flag said so in its help but let 1 through to a traceback.
    (["--keep", "1"], "--keep must be >= 2 (a corrupt newest checkpoint needs an older one to fall back to), got 1"),
    (["--save-every-steps", "-2"], "--save-every-steps: got -2; allowed: an integer"),
    (["--save-every-seconds", "nan"], "--save-every-seconds: got nan; allowed: a number"),
    (["--save-every-seconds", "0.5"], "--save-every-seconds: got 0.5; allowed: a number"),
])
def test_a_bad_flag_exits_2_naming_it(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_trainer_arguments(_parser(), argv, "threads")
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
