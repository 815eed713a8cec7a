"""Benchmark of the node agent's boot against a local moto server (``make bench-agent``).

Two measurements, for a same-AZ reattach and a cross-AZ move of the data volume:

1. **End to end**: ``python -m spot_training.agent run`` as a real process (IMDSv2 emulator for identity, the
   moto server for EC2, volumes as directories), from process start to its "training started" log
   line (the supervisor has started the trainer on the mounted volume). Python start-up and imports
   included.
2. **Volume step in process**: :func:`spot_training.agent.ebs.prepare_data_volume` alone, with the AWS API
   calls it makes counted by a botocore ``before-call`` hook, beside the calls of the original
   article's user-data script (/work/shared/seeds/000_*.txt, counted from its text when present).

Default timeouts are used (lease settle 1.0 s included). The goal: under 2 s of agent overhead for
the same AZ locally (``agent_s``: from the agent's first log line to "training started"), and no more AWS calls than the article's plus the lease's (write, read back,
release = 3). Prints a table, then the figures as JSON on the last line.
"""

from __future__ import annotations

import datetime
import getpass
import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import boto3  # noqa: E402

from spot_training.agent.blockdev import DirectoryBlockDevices  # noqa: E402
from spot_training.agent.config import parse_config  # noqa: E402
from spot_training.agent.ebs import prepare_data_volume  # noqa: E402
from spot_training.local.imds_emulator import ImdsEmulator  # noqa: E402
from spot_training.local.moto_server import MotoServer  # noqa: E402

STACK = "SpotTraining"
IMAGE_ID = "ami-0123456789abcdef0"
REPEATS = int(os.environ.get("BENCH_AGENT_REPEATS", "5"))
LEASE_CALLS = 3  # CreateTags (write), DescribeVolumes (read back), DeleteTags (release)
SEEDS = "/work/shared/seeds/000_*.txt"
# The article's script as published (seed 000), when the seed file is not on this machine:
# same AZ: describe-volumes (id), describe-volumes (AZ), attach-volume;
# other AZ: + create-snapshot, wait snapshot-completed (>= 1 DescribeSnapshots), delete-volume,
#   create-volume, wait volume-available (>= 1 DescribeVolumes).
ARTICLE_FALLBACK = {"same_az": 3, "cross_az": 8}


def _is_call(line: str) -> bool:
    """A shell line that runs ``aws ec2 ...`` (the article's prose around the script is not ASCII)."""
    line = line.replace("\xa0", " ")  # the published page indents the script with non-breaking spaces
    return line.isascii() and re.match(r"\s*(\w+=\$\()?aws ec2 ", line) is not None


def article_calls() -> dict[str, object]:
    """Count the AWS CLI calls of the article's user-data script up to the training start."""
    paths = sorted(glob.glob(SEEDS))
    if not paths:
        return {**ARTICLE_FALLBACK, "source": "built-in (seed file not found)"}
    text = Path(paths[0]).read_text(encoding="utf-8")
    start = text.index("INSTANCE_ID=$(curl")
    end = text.index("sudo -H -u ubuntu", start)  # the script starts training here
    script = text[start:end]
    calls = [line.replace("\xa0", " ").strip() for line in script.splitlines() if _is_call(line)]
    branch_start = script.index("if [ $VOLUME_AZ != $INSTANCE_AZ ]")
    branch_end = script.index("\nfi", branch_start)
    in_branch = [line.strip() for line in script[branch_start:branch_end].splitlines() if _is_call(line)]
    return {"same_az": len(calls) - len(in_branch), "cross_az": len(calls), "source": paths[0],
            "calls": calls}


def _config(work: Path, imds_endpoint: str | None = None) -> dict:
    mount = work / "dltraining"
    code = work / "code"
    code.mkdir(parents=True, exist_ok=True)
    (code / "train.py").write_text("import signal, sys, time\n"
                                   "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                                   "time.sleep(600)\n")
    return {
        "schema_version": 1, "region": "us-east-1", "stack_name": STACK, "node_role": "single",
        "volume": {"tags": {"spot-training:stack": STACK, "spot-training:purpose": "data-volume"},
                   "device_name": "/dev/sdf", "mount_point": str(mount), "fs_type": "xfs", "keep_snapshots": 2},
        "efs": None,
        "training": {"framework": "tensorflow", "python": sys.executable, "command": ["{python}", "train.py"],
                     "user": getpass.getuser(), "dataset_dir": str(mount / "datasets"),
                     "checkpoint_dir": str(mount / "checkpoints"), "log_dir": str(mount / "logs"),
                     "code": {"type": "asset", "path": str(code)}},
        "cleanup": {"cancel_fleet_on_success": False},
        "imds_endpoint": imds_endpoint,
    }


def _setup(server: MotoServer, instance_az: str) -> tuple[object, str]:
    server.reset()
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=server.endpoint_url,
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    ec2.create_volume(AvailabilityZone="us-east-1a", Size=100, VolumeType="gp3", TagSpecifications=[{
        "ResourceType": "volume", "Tags": [{"Key": "spot-training:stack", "Value": STACK},
                                           {"Key": "spot-training:purpose", "Value": "data-volume"}]}])
    instance_id = ec2.run_instances(ImageId=IMAGE_ID, MinCount=1, MaxCount=1, InstanceType="p3.2xlarge",
                                    Placement={"AvailabilityZone": instance_az})["Instances"][0]["InstanceId"]
    return ec2, instance_id


def in_process(server: MotoServer, work: Path, instance_az: str) -> tuple[float, list[str]]:
    """Seconds and API calls of prepare_data_volume for one fresh boot.

    Args:
        server: the moto server (reset first).
        work: a scratch directory.
        instance_az: the AZ of the booting instance (the volume is in us-east-1a).

    Returns:
        ``(seconds, EC2 operation names in call order)``.
    """
    ec2, instance_id = _setup(server, instance_az)
    run_dir = Path(tempfile.mkdtemp(dir=work))
    config = parse_config(_config(run_dir))
    calls: list[str] = []
    ec2.meta.events.register("before-call.ec2", lambda model, **_: calls.append(model.name))
    start = time.perf_counter()
    prepare_data_volume(ec2=ec2, config=config, instance_id=instance_id, availability_zone=instance_az,
                        blockdev=DirectoryBlockDevices(server.volumes_dir))
    return time.perf_counter() - start, calls


def _log_time(line: str) -> float:
    stamp = json.loads(line)["time"]  # 2026-11-21T06:24:07.123Z
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc).timestamp()


def end_to_end(server: MotoServer, work: Path, instance_az: str) -> tuple[float, float]:
    """Seconds from starting ``python -m spot_training.agent run`` to its "training started" line, and seconds
    from the agent's first log line (interpreter up, modules imported) to that line.

    Args:
        server: the moto server (reset first).
        work: a scratch directory.
        instance_az: the AZ of the booting instance (the volume is in us-east-1a).

    Returns:
        ``(seconds to "training started", seconds from the agent's first log line to it)``.

    Raises:
        RuntimeError: the agent did not start training within 120 seconds.
    """
    ec2, instance_id = _setup(server, instance_az)
    run_dir = Path(tempfile.mkdtemp(dir=work))
    with ImdsEmulator.from_moto(ec2, instance_id) as imds:
        config_path = run_dir / "config.json"
        config_path.write_text(json.dumps(_config(run_dir, imds.endpoint)))
        env = {**os.environ, **server.env("us-east-1"), "SPOT_TRAINING_BLOCKDEV_DIR": str(server.volumes_dir),
               "PYTHONPATH": str(REPO)}
        start = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "spot_training.agent", "run", "--config", str(config_path)],
                                   cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = threading.Event()
        lines: list[str] = []

        def pump() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line)
                if '"training started"' in line:
                    started.set()
            started.set()

        threading.Thread(target=pump, daemon=True).start()
        ok = started.wait(timeout=120)
        elapsed = time.perf_counter() - start
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        started_lines = [line for line in lines if '"training started"' in line]
        if not ok or not started_lines:
            raise RuntimeError("the agent did not start training:\n" + "".join(lines[-20:]) + (process.stderr.read() if process.stderr else ""))
        first = next(line for line in lines if line.startswith("{"))
        return elapsed, _log_time(started_lines[0]) - _log_time(first)


def main() -> int:
    """Run the benchmark and print its figures, the last line JSON.

    Returns:
        0.
    """
    article = article_calls()
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        work = Path(tmp)
        with MotoServer(work / "moto") as server:
            for path, az in (("same_az", "us-east-1a"), ("cross_az", "us-east-1b")):
                in_proc = [in_process(server, work, az) for _ in range(REPEATS)]
                e2e = [end_to_end(server, work, az) for _ in range(max(1, REPEATS // 2))]
                calls = in_proc[-1][1]
                results[path] = {
                    "end_to_end_s": round(statistics.median(t for t, _ in e2e), 3),
                    "agent_s": round(statistics.median(a for _, a in e2e), 3),
                    "volume_step_s": round(statistics.median(t for t, _ in in_proc), 3),
                    "api_calls": len(calls),
                    "call_sequence": calls,
                    "article_calls": article[path],
                    "article_plus_lease": int(article[path]) + LEASE_CALLS,
                }
    print(f"{'path':<10} {'process start->training (s)':>28} {'agent->training (s)':>20} {'volume step (s)':>16} "
          f"{'API calls':>10} {'article':>8} {'article+lease':>14}")
    for path, row in results.items():
        print(f"{path:<10} {row['end_to_end_s']:>28.3f} {row['agent_s']:>20.3f} {row['volume_step_s']:>16.3f} "
              f"{row['api_calls']:>10} {row['article_calls']:>8} {row['article_plus_lease']:>14}")
    for path, row in results.items():
        print(f"{path} calls: {' '.join(row['call_sequence'])}")
    print(f"article's calls counted from: {article['source']}")
    print("process start->training includes Python start-up and imports; agent->training starts at the agent's "
          "first log line; the cross-AZ volume step includes the lease settle delay (1.0 s)")
    summary = {
        "bench": "agent",
        "repeats": REPEATS,
        "same_az_end_to_end_s": results["same_az"]["end_to_end_s"],
        "same_az_agent_s": results["same_az"]["agent_s"],
        "same_az_volume_step_s": results["same_az"]["volume_step_s"],
        "same_az_api_calls": results["same_az"]["api_calls"],
        "cross_az_end_to_end_s": results["cross_az"]["end_to_end_s"],
        "cross_az_agent_s": results["cross_az"]["agent_s"],
        "cross_az_volume_step_s": results["cross_az"]["volume_step_s"],
        "cross_az_api_calls": results["cross_az"]["api_calls"],
        "article_same_az_calls": results["same_az"]["article_calls"],
        "article_cross_az_calls": results["cross_az"]["article_calls"],
        "lease_calls": LEASE_CALLS,
        "same_az_goal_met": results["same_az"]["agent_s"] < 2.0,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
