"""Elastic MXNet cluster figures on this machine: join time, leave time, throughput with 1/2/3 workers.

    python bench/bench_elastic.py [--window-s 12] [--framework mxnet]        (make bench-elastic)

Real agents (``python -m bootstrap run``) and real ps-lite processes, each node in its own network
namespace (tests/cluster/cluster_harness.py; loopback fallback), EFS as a shared directory, the 8x8
digits, the MLP of ``training.distributed.mxnet_dist`` with 64 examples per worker per step
(``--per-worker-batch 64``: the global batch grows with the workers, as in the P3 article).

- join: a new worker's agent starts -> its first training step (registration, debounce, the
  checkpoint-and-restart of the generation and ``import mxnet`` included). Goal < 30 s locally.
- leave: spot interruption notice posted to the worker's IMDS -> the first step of the generation
  without it.
- throughput: examples/s in the steady state of the generation with 1, 2, 3 workers, and relative to
  one plain process (no kvstore) running the same model and batch. On 2 shared cores every extra
  process takes CPU from the others, so this measures overhead, not speed-up.

Prints a table, then the figures as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from cluster_harness import Cluster, Network  # noqa: E402

from training.examples.prepare_data import prepare_digits  # noqa: E402

PER_WORKER_BATCH = 64
TRAINER = "training.distributed.mxnet_dist"


def _rate(rows: list[dict], *, skip: int = 5) -> float:
    """Steps per second over the rows of one process after the first ``skip`` (warm-up)."""
    rows = rows[skip:]
    if len(rows) < 5:
        return 0.0
    return (len(rows) - 1) / (float(rows[-1]["wall_time"]) - float(rows[0]["wall_time"]))


def single_process(data: Path, work: Path, steps: int) -> float:
    """Examples/s of one plain process (kvstore 'local', one worker)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    env.update(PYTHONPATH=str(REPO), SPOT_TRAINING_NODE_ID="single", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", TRAINER, "--steps", str(steps), "--per-worker-batch", str(PER_WORKER_BATCH),
                    "--save-every-steps", "0", "--data-dir", str(data), "--checkpoint-dir", str(work / "ckpt"),
                    "--log-dir", str(work / "logs")], cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    import csv
    with open(work / "logs" / "steps-single.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return _rate(rows) * PER_WORKER_BATCH


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window-s", type=float, default=12.0, help="seconds of steady state per worker count")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    network = Network()
    cluster = None
    figures: dict = {"framework": "mxnet", "per_worker_batch": PER_WORKER_BATCH, "cores": os.cpu_count(),
                     "netns": network.netns}
    try:
        data = root / "data"
        prepare_digits(data)
        figures["single_process_examples_per_s"] = round(single_process(data, root / "single", 600), 1)
        cluster = Cluster(root / "cluster", network, framework="mxnet", data_dir=data, trainer_module=TRAINER,
                          trainer_args=["--steps", "10000000", "--per-worker-batch", str(PER_WORKER_BATCH),
                                        "--save-every-steps", "50"],
                          heartbeat_timeout_s=8.0, debounce_s=1.0, kill_grace_s=3.0)
        cluster.add_node("scheduler")
        cluster.add_node("server")
        cluster.add_node("server")
        first = cluster.add_node("worker")
        cluster.wait_for(lambda: cluster.steps(first), 300, "the first worker's first step")
        throughput, joins = {}, []
        workers = [first]
        for count in (1, 2, 3):
            if count > 1:
                node = cluster.add_node("worker")
                workers.append(node)
                rows = cluster.wait_for(lambda: cluster.steps(node), 300, f"worker {count}'s first step")
                joins.append(float(rows[0]["wall_time"]) - node.started_at)
            gen = cluster.plan().generation
            time.sleep(args.window_s)
            mine = [r for r in cluster.steps(workers[0]) if int(r["generation"]) == gen]
            throughput[count] = _rate(mine) * PER_WORKER_BATCH * count
        leaver = workers[-1]
        before = cluster.plan().generation
        leaver.imds.post_spot_interruption()
        noticed = time.time()
        gen = cluster.wait_for(lambda: cluster.running_generation(generation_above=before, workers=2), 300,
                               "the generation without the leaver")
        rows = cluster.wait_for(lambda: cluster.steps_in_generation(gen), 300, "training to continue")
        leave_s = float(rows[0]["wall_time"]) - noticed
        figures.update({
            "join_s": [round(j, 1) for j in joins], "join_goal_s": 30,
            "leave_s": round(leave_s, 1),
            "examples_per_s": {str(k): round(v, 1) for k, v in throughput.items()},
            "relative_to_single_process": {str(k): round(v / figures["single_process_examples_per_s"], 3)
                                           for k, v in throughput.items()},
            "generations": cluster.plan().generation,
        })
    finally:
        if cluster is not None:
            cluster.close()
        network.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'figure':<38} value")
    print(f"{'single process examples/s':<38} {figures['single_process_examples_per_s']}")
    for k, v in figures["examples_per_s"].items():
        print(f"{k + ' worker(s) examples/s (relative)':<38} {v} ({figures['relative_to_single_process'][k]})")
    print(f"{'join: agent start -> first step (s)':<38} {figures['join_s']} (goal < 30)")
    print(f"{'leave: notice -> training on (s)':<38} {figures['leave_s']}")
    print(f"{'network namespaces':<38} {figures['netns']} on {figures['cores']} cores")
    print(json.dumps(figures, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
