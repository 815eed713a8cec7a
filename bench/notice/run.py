"""Runs one framework's phase-drill trials in this interpreter; the LAST LINE is a JSON list of the trials.

    <python> -m bench.notice.run bench.notice.keras [--trials 20] [--phases step validation] [--seed 0]
        [--budget-s 110] [--no-resume]

The harness (``bench/bench_notice.py``) starts it with the framework's interpreter (its module's
``PYTHON``), from the repository root. ``--trials`` notices spread over the module's ``PHASES`` (or
``--phases``, in that order, round-robin), each at a random time inside its phase.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.notice.common import NOTICE_BUDGET_S  # noqa: E402


def plan(phases: list[str], trials: int) -> list[str]:
    """``trials`` phases, round-robin over ``phases``, so every phase gets one before any gets two.

    Args:
        phases: the phases, in order.
        trials: how many notices in all.

    Returns:
        the phase of each trial.
    """
    return [phases[i % len(phases)] for i in range(trials)]


def run_trials(module_name: str, *, trials: int, seed: int, phases: list[str] | None = None,
               budget_s: float = NOTICE_BUDGET_S, resume: bool = True) -> list[dict]:
    """Import the module, prepare its context in a temporary directory, run the trials.

    Args:
        module_name: the framework's module, e.g. ``bench.notice.keras``.
        trials: notices in all.
        seed: the random source's seed.
        phases: only these phases (default: the module's ``PHASES``).
        budget_s: seconds from SIGTERM to SIGKILL (default 110).
        resume: resume each run to the end and compare it bitwise (default True).

    Returns:
        the trials' dicts.

    Raises:
        ValueError: a phase the module does not know (the message lists the ones it knows).
    """
    module = importlib.import_module(module_name)
    phases = list(phases or module.PHASES)
    unknown = [p for p in phases if p not in module.PHASES]
    if unknown:
        raise ValueError(f"{module_name} has no phase {unknown}; its phases: {list(module.PHASES)}")
    rng = random.Random(seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-notice-") as tmp:
        ctx = module.prepare(Path(tmp))
        ctx.setdefault("budget_s", budget_s)
        ctx.setdefault("resume", resume)
        for i, phase in enumerate(plan(phases, trials)):
            root = Path(tmp) / f"{i:03d}-{phase.replace('/', '-')}"
            root.mkdir()
            results.append(module.trial(root, ctx, phase=phase, rng=rng))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # progress, for a long full run
    return results


def main(argv: list[str] | None = None) -> int:
    """The runner's command line (module docstring); prints the trials as a JSON last line, returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", help="the framework's module, e.g. bench.notice.keras")
    parser.add_argument("--trials", type=int, default=20, help="notices in all (default 20)")
    parser.add_argument("--phases", nargs="+", default=None, help="default: the module's PHASES")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=NOTICE_BUDGET_S,
                        help=f"SIGKILL this many seconds after the SIGTERM (default {NOTICE_BUDGET_S:g})")
    parser.add_argument("--no-resume", dest="resume", action="store_false",
                        help="skip the resume to the end and its bitwise comparison (the short form)")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.budget_s <= 0:
        parser.error(f"--trials must be >= 1 and --budget-s > 0. Received: {args.trials}, {args.budget_s}")
    print(json.dumps(run_trials(args.module, trials=args.trials, seed=args.seed, phases=args.phases,
                                budget_s=args.budget_s, resume=args.resume)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
