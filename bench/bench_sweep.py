"""Benchmark: a sweep of N = 4, 8, 16 children on local AWS Batch (``make bench-sweep``).

In local mode (docs/sweeps.md): the real CDK CLI deploys ``SpotSweep`` to a moto server once; then
for each N one array job of N children (spot_training.training.examples.sweep_softmax, 200 steps
of softmax regression with 20 ms per step, checkpoints every 25 steps) runs on
spot_training.local.batch.LocalBatch with every child running at once. Child 0 is reclaimed with a
spot notice and child 1 without one (the host taken at once), each at step 60.

Per N: ``wall_s`` (submit -> every child ended), ``submit_to_first_step_s`` (median and max over the
children: submit -> the child's first training-log row; process start, the manifest from S3,
numpy and scikit-learn imports), ``lost_steps`` of the noticed and the unnoticed reclaim (steps
executed twice: with a notice the trainer checkpoints at its current step; without one it loses
the steps since its last checkpoint). On this machine the children share 2 cores, so ``wall_s``
grows with N. Prints a table, then the figures as JSON on the last line.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spot_training import contract  # noqa: E402
from spot_training.local.deploy import CdkCli  # noqa: E402
from spot_training.local.drill import bootstrap_and_deploy  # noqa: E402
from spot_training.local.injector import read_training_log  # noqa: E402
from spot_training.local.moto_server import MotoServer  # noqa: E402
from spot_training.local.sweep_drill import SweepDrillOptions, deployed_batch, empty_bucket, local_sweep_context  # noqa: E402
from spot_training.ops import sweep as sweep_ops  # noqa: E402

SIZES = (4, 8, 16)
STEPS, RECLAIM_AT = 200, 60


def run_one(batch, s3, stack, size: int, work: Path) -> dict:
    """One sweep of ``size`` children on the local AWS Batch; child 0 is reclaimed with a notice, child 1 without.

    Args:
        batch: the :class:`LocalBatch`.
        s3: a boto3 S3 client of the moto server.
        stack: the sweep stack's resources.
        size: children in the array job.
        work: the work directory (the EFS stand-in is under it).

    Returns:
        the sweep's figures (wall seconds, succeeded children, submit-to-first-step seconds, lost steps
        of the noticed and the unnoticed reclaim).

    Raises:
        RuntimeError: the sweep did not end within 900 seconds.
    """
    options = SweepDrillOptions(steps=STEPS)
    sets = [{"lr": 0.1 * (i + 1), "seed": i, "steps": STEPS} for i in range(size)]
    sweep_id = f"bench-{size}"
    t = time.time()
    job_id = sweep_ops.submit(batch, s3, stack, sets, command=options.command(), sweep_id=sweep_id)["job_id"]
    root = work / "efs" / contract.SWEEP_MOUNT_POINT.lstrip("/") / sweep_id
    first: dict[int, float] = {}
    plan = {0: True, 1: False}  # index -> with a notice

    def tick() -> None:
        for index in range(size):
            rows = read_training_log(root / str(index) / contract.LOGS_DIR / contract.TRAINING_LOG_FILE)
            if rows and index not in first:
                first[index] = min(r["wall_time"] for r in rows) - t
            child = batch.child(f"{job_id}:{index}")
            if index in plan and rows and rows[-1]["step"] >= RECLAIM_AT and child.status == "RUNNING" and len(child.attempts) == 1:
                batch.reclaim(f"{job_id}:{index}", notice=plan.pop(index), lead_s=3.0)

    if not batch.wait(timeout_s=900, tick=tick):
        raise RuntimeError(f"the sweep of {size} did not end within 900 s")
    wall = time.time() - t
    lost = {}
    for index, name in ((0, "noticed"), (1, "unnoticed")):
        rows = read_training_log(root / str(index) / contract.LOGS_DIR / contract.TRAINING_LOG_FILE)
        lost[name] = len(rows) - STEPS
    states = [batch.child(f"{job_id}:{i}").status for i in range(size)]
    waits = sorted(first.values())
    return {"children": size, "wall_s": round(wall, 2), "succeeded": states.count("SUCCEEDED"),
            "submit_to_first_step_median_s": round(statistics.median(waits), 2), "submit_to_first_step_max_s": round(waits[-1], 2),
            "lost_steps_noticed_reclaim": lost["noticed"], "lost_steps_unnoticed_reclaim": lost["unnoticed"]}


def main() -> int:
    """Deploy SpotSweep to a moto server and run a sweep of each size in :data:`SIZES`; the last line printed is JSON.

    Returns:
        0.
    """
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        work = Path(tmp)
        with MotoServer(work / "moto") as server:
            cdk = CdkCli(server.endpoint_url, work_dir=work)
            context = local_sweep_context(SweepDrillOptions.instance_types)
            phases: dict[str, float] = {}
            bootstrap_and_deploy(cdk, "SpotSweep", context, record=lambda e: None, phases=phases)
            batch, stack, s3 = deployed_batch(server, "SpotSweep", work_dir=work, instance_types=SweepDrillOptions.instance_types,
                                              max_running=max(SIZES))
            try:
                for size in SIZES:
                    results.append(run_one(batch, s3, stack, size, work))
                    r = results[-1]
                    print(f"N={size:>2}: wall {r['wall_s']:>6.1f} s, submit->first step median {r['submit_to_first_step_median_s']:.1f} s "
                          f"max {r['submit_to_first_step_max_s']:.1f} s, lost steps: noticed {r['lost_steps_noticed_reclaim']}, "
                          f"unnoticed {r['lost_steps_unnoticed_reclaim']}, succeeded {r['succeeded']}/{size}", flush=True)
            finally:
                batch.close()
                empty_bucket(s3, stack.bucket)
                cdk.destroy("SpotSweep", context=context)
    print(json.dumps({"bench": "sweep", "steps_per_child": STEPS, "reclaim_at_step": RECLAIM_AT,
                      "checkpoint_every_steps": SweepDrillOptions.save_every_steps, "deploy_s": phases.get("deploy"), "runs": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
