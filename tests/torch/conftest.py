"""Fixtures for the PyTorch tests (this directory runs in its own pytest process in .venv-torch, with
``--confcutdir=tests/torch``: the Makefile's ``test`` target).

Training runs in subprocesses of ``spot_training/training/examples/torch_resnet.py`` on CPU with deterministic
algorithms and one thread: 60 steps of batch 32 on the 8x8 digits, a few seconds each.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # torch_jobs, job_helpers

try:
    import torch  # noqa: F401
except ImportError:  # collected by the main environment's pytest: these run in .venv-torch (Makefile)
    collect_ignore_glob = ["test_*.py"]

from job_helpers import job_fixtures  # noqa: E402
from tier_guard import pytest_collection_modifyitems, pytest_runtest_call  # noqa: E402,F401  (test tiers)
from torch_jobs import TOTAL_STEPS, Job  # noqa: E402

# digits_dir (session), job (killed at teardown) and reference_state: the final model and optimizer
# state of one uninterrupted run (background saves on the cadence).
digits_dir, job, reference_state = job_fixtures(Job, total_steps=TOTAL_STEPS, reference_name="reference_state",
                                                final_file="final_weights")
