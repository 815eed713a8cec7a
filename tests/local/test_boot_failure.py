"""A boot that cannot succeed, in local mode: the real user data, the real agent, the AWS CLI against moto.

The stack asks for a requirement whose wheel in the nodes' (offline) wheel directory is corrupt: pip
fails the same way at every attempt without saying the requirement is wrong (a requirement no index
has is a final config error at the first node: tests/agent/test_boot_retries.py). Each node's
agent fails to build the trainer's environment, runs the user data's boot-failure script, which reports
(console, instance tag), counts the failed boot on the data volume and shuts the node down; the runner
terminates the instance (terminate shutdown behaviour) and, acting for the fleet, launches a replacement.
The third failed boot in a row cancels the fleet: no endless loop of paid instances.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spot_training.infra.userdata import BOOT_ERROR_TAG, DEFAULT_MAX_FAILED_BOOTS, FAILED_BOOTS_TAG
from spot_training.local.deploy import CdkCli, clients, local_context, stack_resources
from spot_training.local.drill import bootstrap_and_deploy
from spot_training.local.moto_server import MotoServer
from spot_training.local.nodes import NodeRunner

BROKEN = "spot-training-corrupt==1.0"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_broken_requirement_reports_shuts_down_is_replaced_and_the_bound_holds(tmp_path: Path) -> None:
    events: list[dict] = []
    server = MotoServer(tmp_path / "moto").start()
    runner = None
    try:
        aws = clients(server.endpoint_url)
        context = local_context(training_command=["{python}", "-c", "print('never runs')"],
                                extra={"training_requirements": BROKEN})
        bootstrap_and_deploy(CdkCli(server.endpoint_url, work_dir=tmp_path), "SpotTraining", context,
                             record=events.append, phases={})
        stack = stack_resources(aws, "SpotTraining")
        runner = NodeRunner(aws=aws, endpoint_url=server.endpoint_url, volumes_dir=server.volumes_dir, stack=stack,
                            work_dir=tmp_path, on_event=events.append)
        (runner.wheel_dir / "spot_training_corrupt-1.0-py3-none-any.whl").write_bytes(b"not a zip file")
        assert len(runner.sync()) == 1
        zones = sorted(stack.subnets)
        deadline = time.time() + 900
        while runner.fleet_active() or any(node.alive for node in runner.nodes.values()):
            assert time.time() < deadline, f"no end to the boot loop: {[e for e in events if 'instance' in e]}"
            for _ in runner.reap_shutdowns():
                if runner.fleet_active():  # the fleet replaces a terminated instance while it is active
                    instance_id = runner.launch_for_fleet(zones[len(runner.nodes) % len(zones)], instance_type="g5.xlarge")
                    runner.start_node(instance_id)
            time.sleep(0.5)
        runner.reap_shutdowns()

        nodes = list(runner.nodes.values())
        # The retry bound holds: exactly DEFAULT_MAX_FAILED_BOOTS boots, then the fleet was cancelled.
        assert len(nodes) == DEFAULT_MAX_FAILED_BOOTS == 3
        assert not runner.fleet_active()
        for node in nodes:
            log = node.log_path.read_text()
            # The real user data ran, every step of it retried-and-logged, and the agent started.
            assert "spot-training boot: step start-agent ok" in log
            assert '"message": "preparing the trainer\'s environment"' in log
            # The agent gave up with 69 (systemd must not restart it) after reporting the failed step.
            assert node.process.returncode == 69, log[-3000:]
            assert node.shutdown_requested
            console = (node.node_dir / "console.log").read_text()
            assert "spot-training: boot failed at step 'environment'" in console and BROKEN.split("=")[0] in console
            tags = {t["Key"]: t["Value"] for t in aws.ec2.describe_tags(
                Filters=[{"Name": "resource-id", "Values": [node.instance_id]}])["Tags"]}
            assert tags[BOOT_ERROR_TAG].startswith("environment: "), tags
            state = aws.ec2.describe_instances(InstanceIds=[node.instance_id])["Reservations"][0]["Instances"][0]["State"]
            assert state["Name"] in ("terminated", "shutting-down")
            assert "training started" not in log
        assert "giving up (failed boots in a row: 3 of at most 3" in (nodes[-1].node_dir / "console.log").read_text()
        assert "giving up" not in (nodes[0].node_dir / "console.log").read_text()
        # The count lives on the data volume, so it survives the instances.
        (volume,) = aws.ec2.describe_volumes(Filters=[{"Name": "tag:spot-training:stack", "Values": ["SpotTraining"]}])["Volumes"]
        assert {t["Key"]: t["Value"] for t in volume["Tags"]}[FAILED_BOOTS_TAG] == "3"
        # Nothing half built is left where a later node would look.
        envs = server.volumes_dir / volume["VolumeId"] / "envs"
        assert not envs.exists() or [p.name for p in envs.iterdir() if not p.name.startswith(".")] == []
    finally:
        if runner is not None:
            runner.close()
        server.stop()
