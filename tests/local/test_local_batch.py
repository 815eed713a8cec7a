"""LocalBatch with real child processes (sweep_child and a stand-in trainer) and moto's EC2 in process."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from spot_training import contract
from spot_training.infra.sweep import CHILD_ENTRY, RETRY_RULES
from spot_training.local.batch import LocalBatch

#: A trainer that never ends by itself: writes its pid, then a heartbeat file every 50 ms.
TRAINER = ("import os, time, pathlib\n"
           "pathlib.Path('pid').write_text(str(os.getpid()))\n"
           "while True:\n    pathlib.Path('beat').write_text(str(time.time())); time.sleep(0.05)\n")


@pytest.fixture
def batch(tmp_path: Path):
    with mock_aws():
        ec2 = boto3.client("ec2", region_name="us-east-1")
        vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24", AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
        job_definition = {"containerProperties": {"command": [*CHILD_ENTRY, "Ref::command"]}, "parameters": {},
                          "retryStrategy": {"attempts": 3, "evaluateOnExit": [
                              {k: v for k, v in (("action", a.lower()), ("onStatusReason", s), ("onExitCode", e), ("onReason", r)) if v}
                              for a, s, e, r in RETRY_RULES]}}
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
        env["SPOT_TRAINING_NOTICE_POLL_INTERVAL_S"] = "0.5"
        local = LocalBatch(ec2=ec2, job_definition=job_definition, subnets={"us-east-1a": subnet}, instance_types=["g5.xlarge"],
                           efs_dir=tmp_path / "efs", work_dir=tmp_path, stack="S", environment=env)
        yield local, ec2
        local.close()


@pytest.mark.slow
def test_unnoticed_reclaim_kills_the_trainer_too_and_batch_retries(batch, tmp_path: Path) -> None:
    local, ec2 = batch
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps([{}, {}]))
    job = local.submit_job(jobName="s", jobQueue="q", jobDefinition="d", arrayProperties={"size": 2},
                           parameters={"command": f"{sys.executable} {trainer}"},
                           containerOverrides={"environment": [{"name": contract.ENV_SWEEP_ID, "value": "s1"},
                                                               {"name": contract.ENV_SWEEP_MANIFEST_URI, "value": str(manifest)}]})
    folder = tmp_path / "efs" / contract.SWEEP_MOUNT_POINT.lstrip("/") / "s1" / "0"
    deadline = time.time() + 60
    while not (folder / "pid").exists() and time.time() < deadline:
        local.tick()
        time.sleep(0.1)
    pid = int((folder / "pid").read_text())
    instance = local.reclaim(f"{job['jobId']}:0", notice=False)
    local.tick()
    time.sleep(0.5)
    local.tick()
    # The host is gone: the trainer (in a session of its own under the child) died with it.
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    [described] = local.describe_jobs(jobs=[f"{job['jobId']}:0"])["jobs"]
    assert described["attempts"][0]["statusReason"] == f"Host EC2 (instance {instance}) terminated."
    assert described["status"] in ("RUNNABLE", "RUNNING")  # retried: attempt 2
    state = ec2.describe_instances(InstanceIds=[instance])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state in ("shutting-down", "terminated")
