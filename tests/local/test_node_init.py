"""Local mode's node init (spot_training/local/node_init.py) and the config root rule local nodes rely on."""

from __future__ import annotations

import pytest

import os
import subprocess
import sys
from pathlib import Path

from spot_training.agent.config import with_root
from spot_training.local.node_init import STANDINS_DIR, parse_unit, run_unit, _Stop

REPO = Path(__file__).resolve().parents[2]


def test_parse_unit_reads_the_service_section_with_repeated_keys() -> None:
    unit = parse_unit("[Unit]\nDescription=x\n[Service]\nExecStart=/bin/true -a\nEnvironment=A=1\nEnvironment=B=2\n"
                      "# a comment\nRestartPreventExitStatus=78 69\n[Install]\nWantedBy=multi-user.target\n")
    assert unit == {"ExecStart": ["/bin/true -a"], "Environment": ["A=1", "B=2"], "RestartPreventExitStatus": ["78 69"]}


def _unit(tmp_path: Path, script: str, restart_prevent: str = "78 69") -> Path:
    (tmp_path / "main.sh").write_text(script)
    unit = tmp_path / "x.service"
    unit.write_text(f"[Service]\nWorkingDirectory={tmp_path}\nExecStart=/bin/bash {tmp_path}/main.sh\n"
                    f"Restart=on-failure\nRestartSec=0.1\nRestartPreventExitStatus={restart_prevent}\n"
                    f"Environment=GREETING=hello\nTimeoutStopSec=5\n")
    return unit


@pytest.mark.integration
def test_unit_restarts_on_failure_until_a_prevented_status(tmp_path: Path) -> None:
    # Exits 75 twice (restarted), then 69 (RestartPreventExitStatus: not restarted).
    script = ('n=$(cat runs 2>/dev/null || echo 0); n=$((n+1)); echo $n > runs; echo "$GREETING" > greeting\n'
              '[ $n -lt 3 ] && exit 75; exit 69\n')
    status = run_unit(_unit(tmp_path, script), root=tmp_path, stop=_Stop())
    assert status == 69
    assert (tmp_path / "runs").read_text().strip() == "3"
    assert (tmp_path / "greeting").read_text().strip() == "hello"  # the unit's Environment=


@pytest.mark.integration
def test_unit_is_not_restarted_after_success_or_a_shutdown(tmp_path: Path) -> None:
    script = 'n=$(cat runs 2>/dev/null || echo 0); echo $((n+1)) > runs; exit 0\n'
    assert run_unit(_unit(tmp_path, script), root=tmp_path, stop=_Stop()) == 0
    assert (tmp_path / "runs").read_text().strip() == "1"
    (tmp_path / "run" / "local-init").mkdir(parents=True)
    (tmp_path / "run" / "local-init" / "shutdown").write_text("shutdown -h now\n")
    (tmp_path / "runs").unlink()
    assert run_unit(_unit(tmp_path, 'n=$(cat runs 2>/dev/null || echo 0); echo $((n+1)) > runs; exit 75\n'),
                    root=tmp_path, stop=_Stop()) == 75
    assert (tmp_path / "runs").read_text().strip() == "1"


@pytest.mark.integration
def test_node_init_runs_user_data_then_the_enabled_unit(tmp_path: Path) -> None:
    root = tmp_path / "root"
    user_data = tmp_path / "user-data"
    user_data.write_text(f"""#!/bin/bash
set -u
install -d "$SPOT_TRAINING_ROOT/etc/systemd/system"
cat > "$SPOT_TRAINING_ROOT/etc/systemd/system/a.service" <<UNIT
[Service]
ExecStart=/bin/bash -c 'echo started-by-init > {tmp_path}/out'
UNIT
systemctl daemon-reload && systemctl enable --now a.service
""")
    env = dict(os.environ, SPOT_TRAINING_ROOT=str(root))
    done = subprocess.run([sys.executable, "-m", "spot_training.local.node_init", "--user-data", str(user_data)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "out").read_text().strip() == "started-by-init"
    assert (root / "run" / "local-init" / "start").read_text().split() == ["a.service"]


@pytest.mark.integration
def test_node_init_starts_nothing_when_the_user_data_fails(tmp_path: Path) -> None:
    user_data = tmp_path / "user-data"
    user_data.write_text("systemctl enable --now a.service\nshutdown -h now\nexit 1\n")
    done = subprocess.run([sys.executable, "-m", "spot_training.local.node_init", "--user-data", str(user_data)], cwd=REPO,
                          env=dict(os.environ, SPOT_TRAINING_ROOT=str(tmp_path / "root")), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert (tmp_path / "root" / "run" / "local-init" / "shutdown").read_text() == "shutdown -h now\n"
    assert "started a.service" not in done.stdout


@pytest.mark.integration
def test_stand_ins_refuse_to_run_outside_a_local_node() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SPOT_TRAINING_ROOT"}
    for name in ("systemctl", "shutdown"):
        done = subprocess.run([str(STANDINS_DIR / name), "-h", "now"], env=env, capture_output=True, text=True)
        assert done.returncode != 0 and "local node" in done.stderr


def test_with_root_puts_the_node_root_before_node_paths_only() -> None:
    deployed = {
        "volume": {"mount_point": "/dltraining", "tags": {"a": "/dltraining"}},
        "efs": {"mount_point": "/mnt/efs", "file_system_id": "fs-12345678"},
        "training": {"python": "/usr/bin/python3", "dataset_dir": "/dltraining/datasets",
                     "checkpoint_dir": "/dltraining/checkpoints", "log_dir": "/mnt/efs/logs",
                     "code": {"type": "asset", "path": "/opt/spot-training/code"},
                     "venv": {"requirements": ["x"], "root": "/dltraining/envs"},
                     "command": ["{python}", "t.py", "--out", "/dltraining/w.npz", "--x", "/dltrainingX/no", "/mnt/efs"]},
    }
    rooted = with_root(deployed, "/node/root")
    assert rooted["volume"]["mount_point"] == "/node/root/dltraining"
    assert rooted["efs"]["mount_point"] == "/node/root/mnt/efs"
    assert rooted["training"]["dataset_dir"] == "/node/root/dltraining/datasets"
    assert rooted["training"]["log_dir"] == "/node/root/mnt/efs/logs"
    assert rooted["training"]["code"]["path"] == "/node/root/opt/spot-training/code"
    assert rooted["training"]["venv"]["root"] == "/node/root/dltraining/envs"
    assert rooted["training"]["command"] == ["{python}", "t.py", "--out", "/node/root/dltraining/w.npz", "--x",
                                             "/dltrainingX/no", "/node/root/mnt/efs"]
    assert rooted["training"]["python"] == "/usr/bin/python3"  # a program, not node data
    assert rooted["volume"]["tags"] == {"a": "/dltraining"}  # tags are not paths
    assert deployed["volume"]["mount_point"] == "/dltraining"  # not changed in place
    assert with_root(deployed, None) is deployed and with_root(deployed, "") is deployed
