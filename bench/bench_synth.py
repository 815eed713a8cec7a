"""Benchmark: wall time of the real `cdk synth` of the SpotTraining stack (app.py, cdk-nag included).

Runs `node_modules/.bin/cdk synth --quiet` REPEAT times (default 3; env BENCH_SYNTH_REPEAT) into a
temporary output directory, with no AWS credentials, and prints one line per run, then a summary.
The LAST LINE is JSON: {"benchmark": "cdk_synth", "unit": "s", "runs": [...], "median_s", "min_s", "max_s", ...}.
Exit status 1 if any synth fails.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CDK = REPO_ROOT / "node_modules" / ".bin" / "cdk"


def synth_once(outdir: Path) -> float:
    """Run one `cdk synth` into ``outdir``; return its wall time in seconds. Raises RuntimeError on failure."""
    env = dict(os.environ)
    env["PATH"] = f"{REPO_ROOT / '.venv' / 'bin'}:{REPO_ROOT / 'node_modules' / '.bin'}:{env.get('PATH', '')}"
    env.update(CDK_DISABLE_CLI_TELEMETRY="true", JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION="1",
               JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION="1")
    for name in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        env.pop(name, None)
    cmd = [str(CDK), "synth", "--no-notices", "--no-version-reporting", "--quiet", "--output", str(outdir)]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0 or not (outdir / "SpotTraining.template.json").is_file():
        raise RuntimeError(f"cdk synth failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return elapsed


def main() -> int:
    """Time ``$BENCH_SYNTH_REPEAT`` (default 3) synths of the app; the last line printed is JSON.

    Returns:
        0; 1 when a synth failed (its stderr printed).

    Raises:
        ValueError: ``BENCH_SYNTH_REPEAT`` < 1.
    """
    repeat = int(os.environ.get("BENCH_SYNTH_REPEAT", "3"))
    if repeat < 1:
        raise ValueError(f"BENCH_SYNTH_REPEAT must be >= 1, got {repeat}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-synth-") as tmp:
        for i in range(repeat):
            try:
                seconds = synth_once(Path(tmp) / f"run{i}")
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                return 1
            runs.append(round(seconds, 3))
            print(f"run {i + 1}/{repeat}: cdk synth {seconds:.2f} s", flush=True)
    summary = {
        "benchmark": "cdk_synth",
        "stack": "SpotTraining",
        "unit": "s",
        "runs": runs,
        "median_s": round(statistics.median(runs), 3),
        "min_s": min(runs),
        "max_s": max(runs),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(f"cdk synth of SpotTraining: median {summary['median_s']:.2f} s, min {summary['min_s']:.2f} s, max {summary['max_s']:.2f} s over {repeat} runs")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
