"""The trainer's virtual environment: real ``python -m venv`` and real pip, offline from a local wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spot_training.agent import trainer_env
from spot_training.agent.config import parse_config
from spot_training.agent.errors import ConfigError
from spot_training.agent.supervisor import EnvironmentBuildFailed, Outcome, Supervisor
from spot_training.local.wheels import PROBE_DISTRIBUTION, write_probe_wheel

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def offline_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip sees only a local wheel directory holding the probe wheel (no index, no network)."""
    wheels = tmp_path / "wheels"
    write_probe_wheel(wheels)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


#: A requirement whose wheel is in the wheel directory but corrupt: pip fails the same way at every
#: attempt without saying the requirement is wrong, so the attempts are bounded, not cut short (a
#: requirement no index has is final at once: tests/agent/test_boot_retries.py).
CORRUPT = "spot-training-corrupt==1.0"


def _corrupt_wheel(wheels: Path) -> None:
    (wheels / "spot_training_corrupt-1.0-py3-none-any.whl").write_bytes(b"not a zip file")


def _probe_prefix(python: str) -> str:
    return subprocess.run([python, "-c", "import spot_training_probe as p; print(p.PREFIX)"], capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.integration
def test_builds_once_then_reuses_without_pip(tmp_path: Path, offline_pip: Path) -> None:
    root = tmp_path / "envs"
    lines: list[str] = []
    first = trainer_env.ensure(sys.executable, root, [PROBE_DISTRIBUTION], log=lines.append)
    assert first["status"] == "built" and first["attempts"] == 1
    assert Path(first["python"]) == root / first["key"] / "bin" / "python"
    assert _probe_prefix(first["python"]) == str(root / first["key"])
    assert (root / first["key"]).is_symlink()  # the commit point is the link, made last
    lines.clear()
    second = trainer_env.ensure(sys.executable, root, [PROBE_DISTRIBUTION], log=lines.append)
    assert second["status"] == "reused" and second["key"] == first["key"] and second["attempts"] == 0
    assert not any("pip" in line for line in lines)  # the warm path installs nothing
    assert second["seconds"] < first["seconds"]


@pytest.mark.integration
def test_key_follows_requirements_and_interpreter() -> None:
    interpreter = trainer_env.probe(sys.executable)
    a = trainer_env.env_key(interpreter, ["x>=1", "y"], False)
    assert a == trainer_env.env_key(interpreter, ["y", " x>=1"], False)  # order and spacing do not matter
    assert a != trainer_env.env_key(interpreter, ["x>=2", "y"], False)
    assert a != trainer_env.env_key(interpreter, ["x>=1", "y"], True)
    assert a != trainer_env.env_key({**interpreter, "version": "3.10.12"}, ["x>=1", "y"], False)


@pytest.mark.integration
def test_half_built_environment_is_never_used(tmp_path: Path, offline_pip: Path) -> None:
    """A node that died mid-build leaves a build directory without the link: the next one builds anew."""
    root = tmp_path / "envs"
    key = trainer_env.env_key(trainer_env.probe(sys.executable), [PROBE_DISTRIBUTION], False)
    dead = root / f".build-{key}-deadbeef"
    (dead / "bin").mkdir(parents=True)
    (dead / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")  # no COMPLETE file
    os.symlink(dead.name, root / key)  # even a link to it: incomplete, so not used
    result = trainer_env.ensure(sys.executable, root, [PROBE_DISTRIBUTION], log=lambda line: None)
    assert result["status"] == "built"
    assert os.readlink(root / key) != dead.name
    assert _probe_prefix(result["python"]) == str(root / key)


@pytest.mark.integration
def test_broken_requirement_fails_after_bounded_attempts_and_leaves_nothing(tmp_path: Path, offline_pip: Path) -> None:
    root = tmp_path / "envs"
    lines: list[str] = []
    slept: list[float] = []
    _corrupt_wheel(offline_pip)
    with pytest.raises(trainer_env.EnvironmentBuildError, match=r"spot-training-corrupt.* failed 2 times"):
        trainer_env.ensure(sys.executable, root, [CORRUPT], attempts=2, backoff_s=1.5,
                           log=lines.append, sleep=slept.append)
    assert slept == [1.5]
    assert sum("pip install failed" in line for line in lines) == 2
    assert list(root.iterdir()) == []  # no link, no build directory


@pytest.mark.integration
def test_inherit_site_packages_sees_the_base_interpreters_packages(tmp_path: Path, offline_pip: Path) -> None:
    result = trainer_env.ensure(sys.executable, tmp_path / "envs", [PROBE_DISTRIBUTION], inherit_site_packages=True,
                                log=lambda line: None)
    # pytest lives in this interpreter's venv only; the new environment finds it through the .pth file.
    out = subprocess.run([result["python"], "-c", "import pytest, spot_training_probe, sys; print(sys.prefix)"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    isolated = trainer_env.ensure(sys.executable, tmp_path / "envs", [PROBE_DISTRIBUTION], log=lambda line: None)
    assert isolated["key"] != result["key"]
    assert subprocess.run([isolated["python"], "-c", "import pytest"], capture_output=True).returncode != 0


@pytest.mark.integration
def test_inherit_site_packages_runs_the_pth_files_of_the_base_site_packages(tmp_path: Path) -> None:
    # A base whose site-packages holds a .pth file (an editable install, or a venv layered over another
    # one, as the development venvs are): what that file adds must be seen too, not only the directory.
    site_dir, nested = tmp_path / "base-site", tmp_path / "nested"
    (nested / "nested_only_module").mkdir(parents=True)
    (nested / "nested_only_module" / "__init__.py").write_text("WHERE = 'nested'\n")
    site_dir.mkdir()
    (site_dir / "layer.pth").write_text(f"{nested}\n")
    interpreter = {**trainer_env.probe(sys.executable), "site_packages": [str(site_dir)]}
    trainer_env._make_venv(sys.executable, tmp_path / "env", interpreter, True, log=lambda line: None)
    out = subprocess.run([str(trainer_env.env_python(tmp_path / "env")), "-c",
                          "import nested_only_module as m; print(m.WHERE)"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "nested"


@pytest.mark.integration
def test_command_line_prints_json_and_exits_69_on_failure(tmp_path: Path, offline_pip: Path) -> None:
    argv = [sys.executable, "-m", "spot_training.agent.trainer_env", "ensure", "--python", sys.executable, "--root",
            str(tmp_path / "envs"), "--requirement", CORRUPT, "--attempts", "1"]
    _corrupt_wheel(offline_pip)
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == trainer_env.EXIT_INSTALL_FAILED == 69
    assert "spot-training-corrupt" in json.loads(done.stdout.splitlines()[-1])["error"]


def _config(tmp_path: Path, command: list[str], venv: dict | None) -> dict:
    mount = tmp_path / "mnt"
    return {
        "schema_version": 1, "region": "us-east-1", "stack_name": "S", "node_role": "single",
        "volume": {"tags": {"spot-training:stack": "S", "spot-training:purpose": "data-volume"},
                   "device_name": "/dev/sdf", "mount_point": str(mount)},
        "training": {"framework": "tensorflow", "python": sys.executable, "command": command,
                     "user": "nosuchuser", "dataset_dir": str(mount / "datasets"),
                     "checkpoint_dir": str(mount / "checkpoints"), "log_dir": str(mount / "logs"),
                     "code": {"type": "asset", "path": str(REPO)}, "venv": venv},
    }


@pytest.mark.integration
def test_supervisor_runs_the_trainer_with_the_environments_python(tmp_path: Path, offline_pip: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    trainer = ("import os, pathlib, sys, spot_training_probe; d = pathlib.Path(os.environ['SPOT_TRAINING_CHECKPOINT_DIR']); "
               "(d / 'prefix').write_text(sys.prefix); (d / 'COMPLETED').write_text('{}')")
    config = parse_config(_config(tmp_path, ["{python}", "-c", trainer],
                                  {"requirements": [PROBE_DISTRIBUTION], "root": str(tmp_path / "mnt" / "envs")}))
    caplog.set_level("INFO", logger="spot_training.agent")
    outcome = Supervisor(config, is_mounted=lambda: True, run_as_current_user_if_missing=True).run()
    assert outcome is Outcome.COMPLETED
    prefix = (tmp_path / "mnt" / "checkpoints" / "prefix").read_text()
    assert prefix.startswith(str(tmp_path / "mnt" / "envs" / ""))
    (tmp_path / "mnt" / "checkpoints" / "COMPLETED").unlink()
    Supervisor(config, is_mounted=lambda: True, run_as_current_user_if_missing=True).run()
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("environment built") == 1 and messages.count("environment reused") == 1


@pytest.mark.integration
def test_supervisor_without_venv_runs_training_python_as_it_is(tmp_path: Path) -> None:
    """An AMI that ships the framework: training.venv null, no environment is built."""
    trainer = ("import os, pathlib, sys; d = pathlib.Path(os.environ['SPOT_TRAINING_CHECKPOINT_DIR']); "
               "(d / 'exe').write_text(sys.executable); (d / 'COMPLETED').write_text('{}')")
    config = parse_config(_config(tmp_path, ["{python}", "-c", trainer], None))
    assert Supervisor(config, is_mounted=lambda: True, run_as_current_user_if_missing=True).run() is Outcome.COMPLETED
    assert (tmp_path / "mnt" / "checkpoints" / "exe").read_text() == sys.executable
    assert not (tmp_path / "mnt" / "envs").exists()


@pytest.mark.integration
def test_supervisor_reports_a_failed_build(tmp_path: Path, offline_pip: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _corrupt_wheel(offline_pip)
    config = parse_config(_config(tmp_path, ["{python}", "-c", "pass"],
                                  {"requirements": [CORRUPT], "root": str(tmp_path / "mnt" / "envs")}))
    supervisor = Supervisor(config, is_mounted=lambda: True, run_as_current_user_if_missing=True,
                            venv_attempts=2, venv_backoff_s=0.1)
    with pytest.raises(EnvironmentBuildFailed, match=r"spot-training-corrupt"):
        supervisor.workspace.prepare_environment()


@pytest.mark.integration
def test_supervisor_reports_a_requirement_no_index_has_as_a_final_config_error(tmp_path: Path, offline_pip: Path) -> None:
    config = parse_config(_config(tmp_path, ["{python}", "-c", "pass"],
                                  {"requirements": ["no-such-package-xyz"], "root": str(tmp_path / "mnt" / "envs")}))
    supervisor = Supervisor(config, is_mounted=lambda: True, run_as_current_user_if_missing=True,
                            venv_attempts=3, venv_backoff_s=30.0)
    with pytest.raises(ConfigError, match=r"training.venv.requirements \['no-such-package-xyz'\]: .*retrying will not help"):
        supervisor.workspace.prepare_environment()  # at once: no 30 s backoff


def test_a_symlinked_environment_root_is_refused(tmp_path: Path) -> None:
    """Root never follows a link the training user could have planted."""
    from spot_training.agent.errors import ConfigError

    (tmp_path / "mnt").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "mnt" / "envs")
    config = parse_config(_config(tmp_path, ["{python}", "-c", "pass"],
                                  {"requirements": ["x"], "root": str(tmp_path / "mnt" / "envs")}))
    with pytest.raises(ConfigError, match=r"training.venv.root: .* is not a plain directory"):
        Supervisor(config, is_mounted=lambda: True, run_as_current_user_if_missing=True).workspace.prepare_environment()


def test_config_rejects_bad_venv_sections() -> None:
    from spot_training.agent.errors import ConfigError

    base = _config(Path("/tmp/x"), ["{python}"], None)
    for venv, problem in [({"requirements": "torch", "root": "/x"}, "training.venv.requirements"),
                          ({"requirements": ["torch; rm -rf /"], "root": "/x"}, "training.venv.requirements"),
                          ({"requirements": [], "root": "relative"}, "training.venv.root"),
                          ({"requirements": [], "root": "/x", "inherit_site_packages": "yes"}, "inherit_site_packages"),
                          ({"requirements": []}, "training.venv.root")]:
        base["training"]["venv"] = venv
        with pytest.raises(ConfigError, match=problem):
            parse_config(base)


@pytest.mark.integration
def test_inherited_site_directories_have_their_own_pth_files_processed(tmp_path: Path) -> None:
    """A base whose packages come through a .pth of its site-packages (an editable install, a layered venv)
    is seen whole by the environment, as the base interpreter sees it."""
    site_dir, extra = tmp_path / "base-site", tmp_path / "extra"
    site_dir.mkdir()
    extra.mkdir()
    (extra / "spot_training_pth_probe.py").write_text("VALUE = 7\n")
    (site_dir / "layer.pth").write_text(f"{extra}\n")
    interpreter = {**trainer_env.probe(sys.executable), "site_packages": [str(site_dir)]}
    build = tmp_path / "env"
    trainer_env._make_venv(sys.executable, build, interpreter, True, lambda line: None)
    out = subprocess.run([str(trainer_env.env_python(build)), "-c", "import spot_training_pth_probe as m; print(m.VALUE)"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "7", out.stderr
