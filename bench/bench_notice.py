"""Phase drill for the notice save: trainers of every front-end stopped the way the node agent stops them.

    .venv/bin/python bench/bench_notice.py [--frameworks pytorch keras tfloop] [--trials 20] [--seed 0]
        [--phases startup step ...] [--budget-s 110] [--no-resume]

For each framework in ``FRAMEWORKS`` the harness runs ``<python> -m bench.notice.run <module>`` with
the module's interpreter (``PYTHON``: ``.venv`` or ``.venv-torch``; TensorFlow, MXNet and PyTorch
never share a process). The module (``bench/notice/<name>.py``, interface in
``bench/notice/__init__.py``) starts its trainer as the agent starts one
(:class:`spot_training.agent.process_group.ProcessGroup`) and sends ``--trials`` notices as the agent
does (``ProcessGroup.stop``: SIGTERM to the whole group, SIGKILL after ``--budget-s``), each at a
random time inside one of its phases (round-robin over them): startup and restore, a step, data
loading with workers, a validation pass longer than the budget, the first trace or compile, a
background write in flight.

Per framework and phase it reports: notice checkpoint committed (trials whose newest checkpoint
holds every step that ran), steps lost (steps run - steps in the newest checkpoint; goal 0), exit
statuses (goal 0), worker deaths, bitwise resumes (the run resumed to the end against the
uninterrupted reference, where the docs promise exactness) and notice -> committed seconds p50/p99
(the newest manifest's ``wall_time`` minus the time SIGTERM was sent; 0 when the notice found nothing
new to save) and the longest notice -> exit (the trainer's end, SIGKILL included). Prints a table, then a LAST LINE of JSON ``{framework: {phase: row}}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.notice.common import NOTICE_BUDGET_S, summarise  # noqa: E402

#: name -> the module of its trials (bench/notice/__init__.py says what a module defines).
FRAMEWORKS = {
    "pytorch": "bench.notice.pytorch",
    "keras": "bench.notice.keras",
    "tfloop": "bench.notice.tfloop",
    "gluon": "bench.notice.gluon",
    "torchrun": "bench.notice.torchrun",
}
#: A module's PYTHON -> its interpreter, relative to the repository root.
INTERPRETERS = {"venv": ".venv/bin/python", "torch": ".venv-torch/bin/python"}


def _module_attrs(module_name: str) -> tuple[str, tuple[str, ...]]:
    """A module's PYTHON and PHASES (modules import their framework only inside their functions)."""
    module = importlib.import_module(module_name)
    return module.PYTHON, tuple(module.PHASES)


def run_framework(name: str, *, trials: int, seed: int, phases: list[str] | None = None,
                  budget_s: float = NOTICE_BUDGET_S, resume: bool = True, timeout_s: float = 7200.0) -> list[dict]:
    """One framework's trials in a process of its interpreter.

    Args:
        name: a key of :data:`FRAMEWORKS`.
        trials: notices in all.
        seed: the random source's seed.
        phases: only these phases (default: the module's own).
        budget_s: seconds from SIGTERM to SIGKILL (default 110).
        resume: resume each run to the end and compare it bitwise (default True).
        timeout_s: seconds the runner may take (default 7200).

    Returns:
        the trial dicts.

    Raises:
        RuntimeError: the runner failed or printed no JSON last line.
    """
    module = FRAMEWORKS[name]
    python, _known = _module_attrs(module)
    command = [str(REPO / INTERPRETERS[python]), "-m", "bench.notice.run", module, "--trials", str(trials),
               "--seed", str(seed), "--budget-s", str(budget_s)]
    if phases:
        command += ["--phases", *phases]
    if not resume:
        command.append("--no-resume")
    # stderr passes through: one JSON line per finished trial, the progress of a long run.
    proc = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name}: {' '.join(command)} exited {proc.returncode} (its stderr is above)")
    return json.loads(lines[-1])


def run(frameworks: list[str], *, trials: int, seed: int = 0, phases: list[str] | None = None,
        budget_s: float = NOTICE_BUDGET_S, resume: bool = True) -> dict:
    """Every framework's trials.

    Args:
        frameworks: keys of :data:`FRAMEWORKS`.
        trials: notices per framework.
        seed: the random source's seed.
        phases: keeps, per framework, the ones it has (a framework with none of them is skipped).
        budget_s: seconds from SIGTERM to SIGKILL (default 110).
        resume: resume each run to the end and compare it bitwise (default True).

    Returns:
        ``{framework: {phase: row}}`` (:func:`bench.notice.common.summarise`).
    """
    tables = {}
    for name in frameworks:
        _python, known = _module_attrs(FRAMEWORKS[name])
        own = [p for p in phases if p in known] if phases else None
        if phases and not own:
            continue
        tables[name] = summarise(run_framework(name, trials=trials, seed=seed, phases=own, budget_s=budget_s,
                                                  resume=resume))
    return tables


def main(argv: list[str] | None = None) -> int:
    """The drill's command line (module docstring): prints a table, then a JSON last line; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", nargs="+", choices=list(FRAMEWORKS), default=list(FRAMEWORKS))
    parser.add_argument("--trials", type=int, default=20, help="notices per framework, over its phases (default 20)")
    parser.add_argument("--phases", nargs="+", default=None, help="only these phases (default: every module's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=NOTICE_BUDGET_S,
                        help=f"notice budget: SIGKILL this long after SIGTERM (default {NOTICE_BUDGET_S:g}); "
                             "the validation phase's pass lasts 150/110 of it")
    parser.add_argument("--no-resume", dest="resume", action="store_false",
                        help="skip each run's resume to the end and its bitwise comparison (the short form)")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.budget_s <= 0:
        parser.error(f"--trials must be >= 1 and --budget-s > 0. Received: {args.trials}, {args.budget_s}")
    tables = run(args.frameworks, trials=args.trials, seed=args.seed, phases=args.phases, budget_s=args.budget_s,
                 resume=args.resume)
    print(f"{'framework':<10} {'phase':<14} {'trials':>6} {'committed':>9} {'lost max':>8} {'exits':>8} "
          f"{'bitwise':>7} {'p50 s':>7} {'p99 s':>7} {'exit max s':>10}")
    for name, table in tables.items():
        for phase, row in table.items():
            print(f"{name:<10} {phase:<14} {row['trials']:>6} {row['committed']:>9} {row['steps_lost_max']:>8} "
                  f"{','.join(map(str, row['exits'])):>8} {row['bitwise']!s:>7} "
                  f"{row['notice_to_committed_p50_s']!s:>7} {row['notice_to_committed_p99_s']!s:>7} {row['notice_to_exit_max_s']!s:>10}")
    print(json.dumps(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
