"""spot_training.infra.userdata.extract_config: pure Python, reads back exactly what the stack wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spot_training.infra.userdata import CONFIG_BEGIN, CONFIG_END, boot_script, config_block, extract_config, node_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def _user_data(config: dict) -> str:
    lines = ["#!/bin/bash", *boot_script(asset_url="s3://bucket/asset.zip", region=config["region"],
                                         stack_name=config["stack_name"], volume_tags=config["volume"]["tags"],
                                         config_json=json.dumps(config, indent=2), boto3_requirement="boto3>=1.34,<2")]
    return "\n".join(lines) + "\n"


def _config() -> dict:
    return node_config(region="eu-west-1", stack_name="S", volume_tags={"spot-training:stack": "S"}, framework="mxnet",
                       python="/usr/bin/python3", command=["{python}", "train.py"], efs=None, imds_endpoint="http://127.0.0.1:1")


def test_round_trip() -> None:
    config = _config()
    assert extract_config(_user_data(config)) == config


def test_round_trip_with_awkward_text() -> None:
    config = _config()
    config["training"]["command"] = ["{python}", "-c", "print('EOF'); print(\"# END spot-training config\")"]
    assert extract_config(_user_data(config)) == config


def test_fails_when_markers_are_missing() -> None:
    with pytest.raises(ValueError, match=r"exactly one '# BEGIN spot-training config' line .* found 0 BEGIN and 0 END"):
        extract_config("#!/bin/bash\necho hi\n")


def test_fails_when_block_is_repeated() -> None:
    text = _user_data(_config())
    with pytest.raises(ValueError, match=r"found 2 BEGIN and 2 END"):
        extract_config(text + text)


def test_fails_when_json_is_broken() -> None:
    text = _user_data(_config()).replace('"schema_version": 1', '"schema_version": ')
    with pytest.raises(ValueError, match=r"the config block is not valid JSON"):
        extract_config(text)


def test_fails_when_heredoc_is_not_closed() -> None:
    text = f"{CONFIG_BEGIN}\ncat > /x <<'TAG'\n{{}}\n{CONFIG_END}\n"
    with pytest.raises(ValueError, match=r"<<'TAG' is not closed"):
        extract_config(text)


def test_fails_when_not_text() -> None:
    with pytest.raises(ValueError, match=r"user_data_text must be str .* got bytes"):
        extract_config(b"abc")  # type: ignore[arg-type]


def test_user_data_is_valid_bash_and_writes_the_config(tmp_path: Path) -> None:
    """Run the config block of the user data with real bash, into a temporary root."""
    config = _config()
    block = "\n".join(config_block(json.dumps(config, indent=2))).replace("/etc/spot-training", str(tmp_path / "etc"))
    subprocess.run(["bash", "-euo", "pipefail", "-c", block], check=True)
    assert json.loads((tmp_path / "etc" / "config.json").read_text()) == config
    subprocess.run(["bash", "-n", "-c", _user_data(config)], check=True)


def test_importing_extract_config_does_not_load_the_cdk() -> None:
    code = "import sys, spot_training.infra.userdata; sys.exit(1 if 'aws_cdk' in sys.modules or 'jsii' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


def test_boto3_requirement_matches_requirements_agent() -> None:
    from spot_training.infra.stack import BOTO3_REQUIREMENT

    lines = [ln.split("#")[0].strip() for ln in (REPO_ROOT / "requirements-agent.txt").read_text().splitlines()]
    assert BOTO3_REQUIREMENT in lines


def _efs_utils_script(tmp_path: Path, *, helper_present: bool, apt_fails: bool, local_mode: bool = False,
                      extra_env: dict[str, str] | None = None, lock: Path | None = None, fail_first: bool = False,
                      builds: bool = False) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the efs-utils step with real bash under set -euo pipefail; apt-get, git, sleep are stubs
    that log their calls (nothing is installed or downloaded). ``lock``: a file standing for a held
    dpkg lock (apt-get waits for it only with DPkg::Lock::Timeout, as apt does); ``fail_first``: the
    first ``apt-get update`` fails; ``builds``: git clone and build-deb.sh succeed and installing the
    .deb puts a ``mount.efs`` on PATH."""
    from spot_training.infra.userdata import efs_utils_install_commands

    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    apt = [f"echo apt-get \"$@\" >> {log}"]
    if lock is not None:
        apt.append(f'if [ -e {lock} ]; then case "$*" in *DPkg::Lock::Timeout=*) '
                   f'while [ -e {lock} ]; do /bin/sleep 0.1; done; echo "apt-get waited for the lock" >> {log};; '
                   '*) echo "E: Could not get lock /var/lib/dpkg/lock-frontend" >&2; exit 100;; esac; fi')
    if fail_first:
        apt.append(f'if [ ! -e {tmp_path}/apt-failed-once ]; then touch {tmp_path}/apt-failed-once; exit 100; fi')
    if builds:
        apt.append(f'case "$*" in *amazon-efs-utils*deb*) printf "#!/bin/bash\\nexit 0\\n" > {bin_dir}/mount.efs; '
                   f'chmod +x {bin_dir}/mount.efs;; esac')
    apt.append(f"exit {1 if apt_fails else 0}")
    git = (f'echo git "$@" >> {log}; dest="${{@: -1}}"; mkdir -p "$dest"; '
           'printf "#!/bin/bash\\nmkdir -p build && touch build/amazon-efs-utils_1_all.deb\\n" > "$dest/build-deb.sh"; '
           'chmod +x "$dest/build-deb.sh"') if builds else f'echo git "$@" >> {log}; exit 1'
    stubs = {"apt-get": "\n".join(apt), "git": git, "sleep": f"echo sleep \"$@\" >> {log}"}
    if helper_present:
        stubs["mount.efs"] = "exit 0"
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = "\n".join(efs_utils_install_commands())
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **({"SPOT_TRAINING_BLOCKDEV_DIR": str(tmp_path / "volumes")} if local_mode else {}),
           **(extra_env or {})}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script + "\necho user-data-goes-on"], env=env,
                            capture_output=True, text=True, timeout=60)
    return result, (log.read_text().splitlines() if log.exists() else [])


def test_efs_utils_step_does_nothing_when_mount_efs_is_there(tmp_path: Path) -> None:
    result, calls = _efs_utils_script(tmp_path, helper_present=True, apt_fails=False)
    assert result.returncode == 0 and "user-data-goes-on" in result.stdout
    assert calls == []


def test_efs_utils_step_retries_with_backoff_for_its_budget_then_fails_the_boot_counted(tmp_path: Path) -> None:
    """No transient failure is final: apt keeps failing, the install is retried with doubling waits
    until the retry budget is spent; then the boot fails at step efs-utils (counted, replaced), not as
    the agent's final config error."""
    from spot_training.infra.userdata import EFS_UTILS_RETRY_BUDGET_S

    boot_failed = tmp_path / "boot-failed"
    boot_failed.write_text(f"#!/bin/bash\necho boot-failed \"$@\" >> {tmp_path / 'calls.log'}\n")
    boot_failed.chmod(0o755)
    result, calls = _efs_utils_script(tmp_path, helper_present=False, apt_fails=True,
                                      extra_env={"BOOT_FAILED": str(boot_failed)})
    waits = [int(c.split()[1]) for c in calls if c.startswith("sleep")]
    assert waits[:5] == [15, 30, 60, 120, 120] and sum(waits) <= EFS_UTILS_RETRY_BUDGET_S < sum(waits) + 120
    assert len([c for c in calls if c.startswith("apt-get") and " update" in c]) == len(waits) + 1
    assert result.returncode == 1 and "user-data-goes-on" not in result.stdout  # the boot ends here
    assert calls[-1].startswith(f"boot-failed efs-utils amazon-efs-utils install failed {len(waits) + 1} attempts")


def test_efs_utils_apt_waits_for_a_held_dpkg_lock_instead_of_failing(tmp_path: Path) -> None:
    """unattended-upgrades holds the dpkg lock at first boot: apt-get waits for it (DPkg::Lock::Timeout)
    and the first attempt succeeds once the lock is released. The stand-in apt-get behaves as apt does:
    without the option it fails at once with "Could not get lock"."""
    lock = tmp_path / "dpkg-lock-held"
    lock.touch()
    releaser = subprocess.Popen(["bash", "-c", f"sleep 1.5; rm -f {lock}"])
    try:
        result, calls = _efs_utils_script(tmp_path, helper_present=False, apt_fails=False, lock=lock, builds=True)
    finally:
        releaser.wait(timeout=30)
    assert result.returncode == 0 and "user-data-goes-on" in result.stdout, result.stderr
    assert not [c for c in calls if c.startswith("sleep")]  # no retry was needed: apt waited
    assert any(c.startswith("apt-get waited for the lock") for c in calls), calls
    assert all("-o DPkg::Lock::Timeout=600" in c for c in calls if c.startswith("apt-get ") and "waited" not in c)
    assert (tmp_path / "bin" / "mount.efs").exists()


def test_efs_utils_install_that_fails_once_succeeds_on_retry(tmp_path: Path) -> None:
    result, calls = _efs_utils_script(tmp_path, helper_present=False, apt_fails=False, fail_first=True, builds=True)
    assert result.returncode == 0 and "user-data-goes-on" in result.stdout, result.stderr
    assert [c for c in calls if c.startswith("sleep")] == ["sleep 15"]
    assert "attempt 1 failed; retrying in 15 s" in result.stderr
    assert (tmp_path / "bin" / "mount.efs").exists()


def test_efs_utils_step_builds_the_pinned_release_as_the_readme_says(tmp_path: Path) -> None:
    from spot_training.infra.userdata import EFS_UTILS_REF, efs_utils_install_commands

    result, calls = _efs_utils_script(tmp_path, helper_present=False, apt_fails=False)
    assert result.returncode == 0
    assert "apt-get -o DPkg::Lock::Timeout=600 -y -q install git binutils" in calls
    assert f"git clone --quiet --depth 1 --branch {EFS_UTILS_REF} https://github.com/aws/efs-utils /tmp/spot-training-efs-utils" in calls
    text = "\n".join(efs_utils_install_commands())
    assert "./build-deb.sh" in text and "build/amazon-efs-utils*deb" in text
    with pytest.raises(ValueError, match="git tag"):
        efs_utils_install_commands(ref="v1; rm -rf /")


def test_efs_utils_step_is_skipped_in_local_mode(tmp_path: Path) -> None:
    """Local mode's switch (SPOT_TRAINING_BLOCKDEV_DIR): its EFS is a directory; nothing is installed."""
    result, calls = _efs_utils_script(tmp_path, helper_present=False, apt_fails=True, local_mode=True)
    assert result.returncode == 0 and "user-data-goes-on" in result.stdout
    assert calls == [] and "failed" not in result.stderr


@pytest.mark.parametrize("botocore_version,installs", [("1.34.162", True), ("1.38.10", False), (None, True)])
def test_agent_boto3_step_upgrades_an_amis_too_old_botocore(tmp_path: Path, botocore_version, installs) -> None:
    """The boot step installs boto3 when the AMI's Python lacks it or has a botocore older than the
    agent needs (1.38.10: VolumeInitializationRate), instead of starting an agent that cannot move a volume."""
    from spot_training.infra.asset import BOTO3_REQUIREMENT
    from spot_training.infra.userdata import boot_script

    lines = boot_script(asset_url="s3://assets/a.zip", region="us-east-1", stack_name="S",
                        volume_tags={"spot-training:stack": "S"}, config_json="{}", boto3_requirement=BOTO3_REQUIREMENT)
    start = lines.index("agent_boto3() {")
    function = "\n".join(lines[start:lines.index("}", start) + 1])
    site = tmp_path / "site"
    if botocore_version is not None:
        for name in ("boto3", "botocore"):
            (site / name).mkdir(parents=True)
        (site / "botocore" / "__init__.py").write_text(f"__version__ = {botocore_version!r}\n")
        (site / "boto3" / "__init__.py").write_text("")
    calls = tmp_path / "calls"
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/bash\nif [ "$1" = "-m" ]; then echo "$@" >> {calls}; exit 0; fi\n'
                      f'PYTHONPATH={site} exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    done = subprocess.run(["bash", "-c", f"AGENT_PYTHON={python}\n{function}\nagent_boto3"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ran = calls.read_text().splitlines() if calls.exists() else []
    assert ran == ([f"-m pip install --quiet {BOTO3_REQUIREMENT}"] if installs else [])


@pytest.mark.parametrize(("aws_error", "final"), [
    ("fatal error: An error occurred (403) when calling the HeadObject operation: Forbidden", True),
    ("fatal error: An error occurred (404) when calling the HeadObject operation: Key \"a.zip\" does not exist", True),
    ('fatal error: Could not connect to the endpoint URL: "https://assets.s3.amazonaws.com/a.zip"', False),
])
def test_fetch_agent_uses_its_attempts_then_reports_a_denied_or_missing_asset_as_final(
        tmp_path: Path, aws_error: str, final: bool) -> None:
    """A wrong asset URL or a denied read still gets the step's attempts (a fresh role's permissions reach
    S3 after a while), then ends the boot as final; a network failure stays a counted failure."""
    from spot_training.infra.asset import BOTO3_REQUIREMENT
    from spot_training.infra.userdata import BOOT_STEP_ATTEMPTS, boot_script

    lines = boot_script(asset_url="s3://assets/a.zip", region="us-east-1", stack_name="S",
                        volume_tags={"spot-training:stack": "S"}, config_json="{}", boto3_requirement=BOTO3_REQUIREMENT)

    def function(name: str) -> str:
        start = lines.index(f"{name}() {{")
        return "\n".join(lines[start:lines.index("}", start) + 1])

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    (bin_dir / "aws").write_text(f"#!/bin/bash\necho aws >> {calls}\necho '{aws_error}' >&2\nexit 1\n")
    (bin_dir / "sleep").write_text("#!/bin/bash\nexit 0\n")
    boot_failed = tmp_path / "boot-failed"
    boot_failed.write_text(f"#!/bin/bash\necho boot-failed \"$@\" >> {calls}\n")
    for path in (*bin_dir.iterdir(), boot_failed):
        path.chmod(0o755)
    script = "\n".join([f'ST_ROOT="{tmp_path}"', f'BOOT_FAILED="{boot_failed}"', function("step"),
                        function("fetch_agent"), "step fetch-agent fetch_agent", "echo not-reached"])
    done = subprocess.run(["bash", "-uo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 1 and "not-reached" not in done.stdout
    logged = calls.read_text().splitlines()
    assert logged.count("aws") == BOOT_STEP_ATTEMPTS
    assert logged[-1].startswith("boot-failed fetch-agent ") and logged[-1].endswith(" final") is final, logged
    assert aws_error in done.stderr
