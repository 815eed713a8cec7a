"""Elastic cluster figures on this machine: join time, leave time, throughput with 1/2/3 workers.

    python bench/bench_elastic.py [--window-s 12] [--framework mxnet|tensorflow|pytorch|all]   (make bench-elastic)

Real agents (``python -m spot_training.agent run``) and real ps-lite processes, each node in its own network
namespace (tests/cluster/cluster_harness.py; loopback fallback), EFS as a shared directory, the 8x8
digits, the MLP of ``spot_training.training.distributed.mxnet_dist`` with 64 examples per worker per step
(``--per-worker-batch 64``: the global batch grows with the workers, as in the P3 article), and the
same MLP under TensorFlow ``ParameterServerStrategy`` (``spot_training.training.distributed.tf_pss``, asynchronous:
one 64-example closure per step on whichever worker is free), and the same MLP under PyTorch DDP on
TorchElastic (``spot_training.training.distributed.torch_ddp`` run by ``torchrun``, gloo, 64 examples per worker per
step; the coordinator's c10d store, no servers; spot_training/agent/torch_elastic.py).

- join: a new worker's agent starts -> its first training step (registration, debounce, the
  checkpoint-and-restart of the generation and ``import mxnet`` included; PyTorch: the first step
  logged with the larger world size). Goal < 30 s locally.
- leave: spot interruption notice posted to the worker's IMDS -> the first step of the generation
  without it.
- throughput: examples/s in the steady state of the generation with 1, 2, 3 workers, relative to
  one plain process (no kvstore) running the same model and batch (MXNet), or to one worker
  (TensorFlow: PSS needs a cluster). On 2 shared cores every extra
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
from torch_harness import TORCH_PYTHON, TorchCluster  # noqa: E402

from spot_training.training.examples.prepare_data import prepare_digits  # noqa: E402

PER_WORKER_BATCH = 64


def _rate(rows: list[dict], *, skip: int = 5) -> float:
    """Steps per second over the rows of one process after the first ``skip`` (warm-up)."""
    rows = rows[skip:]
    if len(rows) < 5:
        return 0.0
    return (len(rows) - 1) / (float(rows[-1]["wall_time"]) - float(rows[0]["wall_time"]))


def single_process(data: Path, work: Path, steps: int) -> float:
    """Examples/s of one plain process (kvstore 'local', one worker).

    Args:
        data: the prepared datasets.
        work: a scratch directory.
        steps: steps to run.

    Returns:
        examples per second.

    Raises:
        subprocess.CalledProcessError: the trainer failed.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    env.update(PYTHONPATH=str(REPO), SPOT_TRAINING_NODE_ID="single", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", TRAINERS["mxnet"], "--steps", str(steps), "--per-worker-batch", str(PER_WORKER_BATCH),
                    "--save-every-steps", "0", "--data-dir", str(data), "--checkpoint-dir", str(work / "ckpt"),
                    "--log-dir", str(work / "logs")], cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    import csv
    with open(work / "logs" / "steps-single.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return _rate(rows) * PER_WORKER_BATCH


TRAINERS = {"mxnet": "spot_training.training.distributed.mxnet_dist", "tensorflow": "spot_training.training.distributed.tf_pss"}


def bench_cluster(framework: str, data: Path, root: Path, network: Network, window_s: float) -> dict:
    """Join, leave and throughput figures of one framework's cluster (see the module docstring).

    Args:
        framework: ``mxnet`` or ``tensorflow``.
        data: the prepared datasets.
        root: the cluster's scratch directory.
        network: hands out node addresses.
        window_s: seconds of steady state per worker count.

    Returns:
        the framework's figures.
    """
    # MXNet: each worker adds 64 examples per step (synchronous). TensorFlow PSS is asynchronous: each
    # step is one closure of 64 examples on whichever worker is free, so more workers = more steps/s.
    trainer_args = (["--per-worker-batch", str(PER_WORKER_BATCH)] if framework == "mxnet"
                    else ["--batch-size", str(PER_WORKER_BATCH)])
    cluster = Cluster(root, network, framework=framework, data_dir=data, trainer_module=TRAINERS[framework],
                      trainer_args=["--steps", "10000000", "--save-every-steps", "50", *trainer_args],
                      heartbeat_timeout_s=10.0, debounce_s=1.0, kill_grace_s=3.0, base_port=9200)
    try:
        cluster.add_node("scheduler")
        cluster.add_node("server")
        cluster.add_node("server")
        first = cluster.add_node("worker")
        cluster.wait_for(lambda: cluster.running_generation(workers=1) and cluster.steps_in_generation(1), 400,
                         "the first step")
        throughput, joins, workers = {}, [], [first]
        for count in (1, 2, 3):
            if count > 1:
                node = cluster.add_node("worker")
                workers.append(node)
                before = cluster.plan().generation
                gen = cluster.wait_for(lambda: cluster.running_generation(generation_above=before, workers=count),
                                       400, f"the generation with {count} workers")
                # MXNet: the new worker's own first step; TensorFlow: the chief's first step of the
                # generation that includes it (closures do not say which worker ran them).
                probe = node if framework == "mxnet" else None
                rows = cluster.wait_for(lambda: [r for r in cluster.steps(probe) if int(r["generation"]) == gen],
                                        400, f"worker {count}'s first step")
                joins.append(float(rows[0]["wall_time"]) - node.started_at)
            gen = cluster.plan().generation
            time.sleep(window_s)
            rows = [r for r in cluster.steps(workers[0] if framework == "mxnet" else None)
                    if int(r["generation"]) == gen]
            per_step = PER_WORKER_BATCH * count if framework == "mxnet" else PER_WORKER_BATCH
            throughput[count] = _rate(rows, skip=10) * per_step
        leaver = workers[-1]
        before = cluster.plan().generation
        leaver.imds.post_spot_interruption()
        noticed = time.time()
        gen = cluster.wait_for(lambda: cluster.running_generation(generation_above=before, workers=2), 400,
                               "the generation without the leaver")
        rows = cluster.wait_for(lambda: cluster.steps_in_generation(gen), 400, "training to continue")
        return {"join_s": [round(j, 1) for j in joins], "leave_s": round(float(rows[0]["wall_time"]) - noticed, 1),
                "examples_per_s": {str(k): round(v, 1) for k, v in throughput.items()},
                "generations": cluster.plan().generation}
    finally:
        cluster.close()


def bench_torch(data: Path, root: Path, network: Network, window_s: float) -> dict:
    """Join, leave and throughput figures of a PyTorch TorchElastic cluster (module docstring).

    Args:
        data: the prepared datasets.
        root: the cluster's scratch directory.
        network: hands out node addresses.
        window_s: seconds of steady state per worker count.

    Returns:
        PyTorch's figures.
    """
    cluster = TorchCluster(root, network, framework="pytorch", data_dir=data, trainer_module="spot_training.training.distributed.torch_ddp",
                           trainer_args=["--steps", "10000000", "--save-every-steps", "50", "--per-worker-batch",
                                         str(PER_WORKER_BATCH)],
                           num_servers=0, heartbeat_timeout_s=10.0, kill_grace_s=3.0, base_port=9400)

    def at(size: int, since: int) -> list[dict]:
        return [r for r in cluster.rows()[since:] if int(r["num_workers"]) == size]

    try:
        cluster.add_node("scheduler")
        first = cluster.add_node("worker")
        rows = cluster.wait_rows(lambda rows: at(1, 0), "the first step", timeout=400)
        throughput, joins, workers = {}, [float(rows[0]["wall_time"]) - first.started_at], [first]
        for count in (1, 2, 3):
            if count > 1:
                since = len(cluster.rows())
                node = cluster.add_node("worker")
                workers.append(node)
                rows = cluster.wait_rows(lambda rows: at(count, since), f"the first step with {count} workers", timeout=400)
                joins.append(float(at(count, since)[0]["wall_time"]) - node.started_at)
            since = len(cluster.rows())
            time.sleep(window_s)
            throughput[count] = _rate(at(count, since), skip=10) * PER_WORKER_BATCH * count
        since = len(cluster.rows())
        workers[-1].imds.post_spot_interruption()
        noticed = time.time()
        cluster.wait_rows(lambda rows: at(2, since), "training to continue without the leaver", timeout=400)
        return {"first_worker_start_s": round(joins[0], 1), "join_s": [round(j, 1) for j in joins[1:]],
                "leave_s": round(float(at(2, since)[0]["wall_time"]) - noticed, 1),
                "examples_per_s": {str(k): round(v, 1) for k, v in throughput.items()},
                "epoch": (cluster.rdzv() or {}).get("epoch")}
    finally:
        cluster.close()


def main(argv=None) -> int:
    """Run the elastic-cluster benchmark for the chosen frameworks; the last line printed is JSON.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window-s", type=float, default=12.0, help="seconds of steady state per worker count")
    parser.add_argument("--framework", choices=["mxnet", "tensorflow", "pytorch", "both", "all"], default="all",
                        help="both: mxnet and tensorflow; all (default): the three, in one run")
    args = parser.parse_args(argv)
    frameworks = {"both": ["mxnet", "tensorflow"], "all": ["mxnet", "tensorflow", "pytorch"]}.get(
        args.framework, [args.framework])
    root = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    network = Network()
    figures: dict = {"per_worker_batch": PER_WORKER_BATCH, "cores": os.cpu_count(), "netns": network.netns,
                     "join_goal_s": 30}
    try:
        data = root / "data"
        prepare_digits(data)
        if "mxnet" in frameworks:
            single = single_process(data, root / "single", 600)
            mx = bench_cluster("mxnet", data, root / "mxnet", network, args.window_s)
            mx["single_process_examples_per_s"] = round(single, 1)
            mx["relative_to_single_process"] = {k: round(v / single, 3) for k, v in mx["examples_per_s"].items()}
            figures["mxnet"] = mx
        if "tensorflow" in frameworks:
            tf = bench_cluster("tensorflow", data, root / "tensorflow", network, args.window_s)
            one = tf["examples_per_s"]["1"] or float("nan")
            tf["relative_to_one_worker"] = {k: round(v / one, 3) for k, v in tf["examples_per_s"].items()}
            figures["tensorflow"] = tf
        if "pytorch" in frameworks:
            if not TORCH_PYTHON.exists():
                raise SystemExit(f"{TORCH_PYTHON} missing: run `make setup`")
            pt = bench_torch(data, root / "pytorch", network, args.window_s)
            one = pt["examples_per_s"]["1"] or float("nan")
            pt["relative_to_one_worker"] = {k: round(v / one, 3) for k, v in pt["examples_per_s"].items()}
            figures["pytorch"] = pt
    finally:
        network.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'framework':<11} {'figure':<40} value")
    for name in frameworks:
        f = figures[name]
        base = ("single_process_examples_per_s", "relative_to_single_process") if name == "mxnet" else \
            (None, "relative_to_one_worker")
        if base[0]:
            print(f"{name:<11} {'single process examples/s':<40} {f[base[0]]}")
        for k, v in f["examples_per_s"].items():
            print(f"{name:<11} {k + ' worker(s) examples/s (relative)':<40} {v} ({f[base[1]][k]})")
        print(f"{name:<11} {'join: agent start -> first step (s)':<40} {f['join_s']} (goal < 30)")
        print(f"{name:<11} {'leave: notice -> training on (s)':<40} {f['leave_s']}")
    print(f"network namespaces: {figures['netns']}; {figures['cores']} cores shared with other jobs")
    print(json.dumps(figures, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
