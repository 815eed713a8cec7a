"""Fixtures for the MXNet Gluon tests (this directory runs in its own pytest process: MXNet 1.9.1
segfaults when TensorFlow was imported first, see the Makefile's `test` target).

Training runs in subprocesses of ``spot_training/training/examples/gluon_resnet.py`` with small settings (90 steps
of batch 32 on the 8x8 digits, about 3 s each), with ``OMP_NUM_THREADS=1`` as the example sets it.
"""

from __future__ import annotations

from gluon_jobs import TOTAL_STEPS, Job
from job_helpers import job_fixtures  # tests/ (gluon_jobs puts it on sys.path)

# digits_dir (session), job (killed at teardown) and reference_params: the final parameters of one
# uninterrupted run (background saves every SAVE_EVERY steps).
digits_dir, job, reference_params = job_fixtures(Job, total_steps=TOTAL_STEPS, reference_name="reference_params",
                                                 final_file="final_params")
