"""The node keeper of ``spot-train local up``: runs the nodes the deployed fleet asks for until ``local down``.

``spot-train local up`` deploys the stack to the moto server, then starts this module as a process of
its own (its own session, PID in ``state.json``)::

    python -m spot_training.local.keeper --state out/local/state.json

It does for the live stack what the drill's :class:`~spot_training.local.nodes.NodeRunner` does for a
drill, once a second: boot a local node for every running fleet instance that has none (the first
instance; one that ``aws ec2 modify-spot-fleet-request`` or a test added), terminate in moto the
instances whose node shut itself down (a failed boot), and those of a fleet the agent cancelled when
training completed. Events go to ``<work_dir>/keeper-events.jsonl``, one JSON object a line.

SIGTERM or SIGINT (``spot-train local down``, or Ctrl-C in a terminal that runs it in the foreground)
stops every node it started, by PID (:meth:`NodeRunner.close`), and ends it with status 0. It ends by
itself, stopping its nodes, when the moto server has been unreachable for :data:`SERVER_GONE_S`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

#: Seconds between two looks at the fleet.
INTERVAL_S = 1.0
#: Seconds the moto server may be unreachable before the keeper stops its nodes and ends.
SERVER_GONE_S = 30.0
EVENTS_FILE = "keeper-events.jsonl"


class _Stop(Exception):
    """Raised from the signal handler: stop the nodes and end."""


def run(state_path: Path, *, interval_s: float = INTERVAL_S) -> int:
    """Keep the nodes of the stack in ``state_path`` running until a signal.

    Args:
        state_path: ``state.json`` of ``local up``.
        interval_s: seconds between two reconciliations of instances and nodes.

    Returns:
        the exit status: 0 after a clean stop, 1 when the stack could not be read.
    """
    from spot_training.local.deploy import clients, stack_resources
    from spot_training.local.moto_server import MotoServer
    from spot_training.local.nodes import NodeRunner

    state = json.loads(Path(state_path).read_text())
    work = Path(state["work_dir"])
    events = open(work / EVENTS_FILE, "a", encoding="utf-8")  # noqa: SIM115 - open for the keeper's life

    def record(event: dict[str, Any]) -> None:
        events.write(json.dumps({"t": round(time.time(), 3), **event}) + "\n")
        events.flush()

    def stop(signum: int, frame: Any) -> None:
        raise _Stop(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    runner: NodeRunner | None = None
    try:
        aws = clients(state["endpoint_url"])
        try:
            stack = stack_resources(aws, state["stack"])
        except Exception as error:  # noqa: BLE001 - reported; nothing was started
            record({"event": "error", "message": f"reading stack {state['stack']} failed: {error}"})
            return 1
        runner = NodeRunner(aws=aws, endpoint_url=state["endpoint_url"],
                            volumes_dir=MotoServer(work / "moto").volumes_dir, stack=stack, work_dir=work,
                            on_event=record)
        record({"event": "keeper-started", "fleet_request_id": stack.fleet_request_id})
        unreachable_since: float | None = None
        while True:
            try:
                runner.sync()
                runner.reap_shutdowns()
                runner.reconcile()
                unreachable_since = None
            except _Stop:
                raise
            except Exception as error:  # noqa: BLE001 - the server may be restarting; give up after a while
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > SERVER_GONE_S:
                    record({"event": "error", "message": f"the local AWS is gone ({error}); stopping the nodes"})
                    return 1
            time.sleep(interval_s)
    except _Stop as why:
        record({"event": "keeper-stopping", "reason": str(why)})
        return 0
    finally:
        if runner is not None:
            runner.close()  # every node by PID; instances it launched terminated
            record({"event": "keeper-stopped", "nodes": sorted(runner.nodes)})
        events.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m spot_training.local.keeper --state STATE``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m spot_training.local.keeper",
                                     description="run the nodes of the local stack's fleet until SIGTERM")
    parser.add_argument("--state", type=Path, required=True, help="state.json of spot-train local up")
    args = parser.parse_args(argv)
    return run(args.state)


if __name__ == "__main__":
    sys.exit(main())
