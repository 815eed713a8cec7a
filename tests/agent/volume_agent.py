"""Test driver: the agent's volume step as a real process (``python tests/agent/volume_agent.py``).

Like ``python -m spot_training.agent attach-volume`` but with the identity given on the command line (no IMDS)
and the timeouts adjustable, so tests can race two agents and kill one at an exact step:

    volume_agent.py --config CFG --instance-id i-1 --az us-east-1b --blockdev-dir DIR \
        [--timeouts '{"lease_wait_s": 2}'] [--pause-after EVENT]

``--pause-after EVENT`` makes the process stop (sleep) right after it logs ``EVENT``, so that a test
can SIGKILL it exactly there. Logs are the agent's JSON lines on stdout; the exit status is the
agent's (0, 75, 78). AWS is whatever ``AWS_ENDPOINT_URL`` points at (the tests' moto server).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import boto3  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

from spot_training.agent.blockdev import DirectoryBlockDevices  # noqa: E402
from spot_training.agent.config import load_config  # noqa: E402
from spot_training.agent.ebs import VolumeTimeouts, prepare_data_volume  # noqa: E402
from spot_training.agent.errors import AgentError, ExitCode  # noqa: E402
from spot_training.agent.logs import flush_logs, setup_logging  # noqa: E402
from spot_training.agent.retry import client_config  # noqa: E402


class _PauseAfter(logging.Handler):
    """Added after the stdout handler: once ``event``'s line is out, stop here until killed."""

    def __init__(self, event: str) -> None:
        super().__init__()
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == self.event:
            sys.stdout.flush()
            while True:
                time.sleep(3600)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--az", required=True)
    parser.add_argument("--blockdev-dir", required=True)
    parser.add_argument("--timeouts", default="{}")
    parser.add_argument("--pause-after", default=None)
    args = parser.parse_args()
    logger = setup_logging()
    if args.pause_after:
        logger.addHandler(_PauseAfter(args.pause_after))
    log = logging.getLogger("spot_training.agent.ebs")
    try:
        config = load_config(args.config)
        ec2 = boto3.client("ec2", region_name=config.region, config=client_config())
        mount_point = prepare_data_volume(
            ec2=ec2, config=config, instance_id=args.instance_id, availability_zone=args.az,
            blockdev=DirectoryBlockDevices(args.blockdev_dir), log=log,
            timeouts=VolumeTimeouts(**json.loads(args.timeouts)))
    except AgentError as error:
        log.error(str(error), extra={"event": "failed", "exit_code": int(error.exit_code)})
        flush_logs()
        return int(error.exit_code)
    except ClientError as error:
        log.error(str(error), extra={"event": "failed", "exit_code": int(ExitCode.TEMPFAIL)})
        return int(ExitCode.TEMPFAIL)
    log.info("done", extra={"event": "done", "mount_point": str(mount_point)})
    flush_logs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
