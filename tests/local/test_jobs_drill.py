"""Two training jobs in one stack, end to end: the real CDK CLI deploys spot_training.local.jobs_app (one
VPC, two ``TrainingJob``s) into the moto server, each job's fleet instance becomes a local node, both
are interrupted at once (job A's replacement stays in its AZ, job B's moves its volume through a
snapshot), both train to the end on their own volumes, and ``spot-train status --job`` / ``cost --job``
each read back one job alone before destroy. The trainers are the numpy softmax example: the test
costs the deploy, not the training.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_drill import _processes_mentioning, run_drill_cli


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_jobs_in_one_stack_each_train_through_an_interruption_on_their_own_volume(tmp_path: Path) -> None:
    work = tmp_path / "jobs"
    completed, report = run_drill_cli(work, "--jobs", "2", "--interruptions", "1", "--steps", "300", timeout=850)
    assert completed.returncode == 0, (report.get("error"), report.get("jobs"), completed.stdout[-3000:])
    assert report["passed"] is True and report["error"] is None
    job_a, job_b = report["job_ids"]
    assert (job_a, job_b) == ("SpotTrainingJobs-JobA", "SpotTrainingJobs-JobB")
    a, b = report["jobs"][job_a], report["jobs"][job_b]
    for job in (a, b):
        assert job["completed"] is True and job["steps_total"] == 300 and job["lost_steps"] == 0
        assert job["interruptions"] == 1 and len(job["instances"]) == 2
        # Every agent exited 0: none refused its config (78, e.g. two independent tagged volumes).
        assert set(job["agent_exit_codes"].values()) == {0}
        # Each ended bitwise equal to its own uninterrupted run (their learning rates differ).
        assert job["matches_uninterrupted_baseline"] is True
        [event] = job["interruption_events"]
        assert event["resumed_at_step"] == event["checkpoint_step"] + 1
        # status --job and cost --job read this job's instances and volume, and only those.
        assert job["reads_only_its_own"] is True
        assert job["status_instances"] == job["cost_instances"] == sorted(job["instances"])
        assert job["status_step"] == 300 and job["status_interruptions"] == 1
    assert a["test_accuracy"] != b["test_accuracy"]
    assert a["az_moves"] == 0 and a["volume_ids"] == [a["interruption_events"][0]["volume_id_after"]]
    assert b["az_moves"] == 1 and len(b["volume_ids"]) == 2 and b["status_volumes"] == [b["interruption_events"][0]["volume_id_after"]]
    assert set(a["instances"]).isdisjoint(b["instances"])
    assert set(a["volume_ids"] + a["volume_dirs"]).isdisjoint(b["volume_ids"] + b["volume_dirs"])
    assert report["volumes_shared"] == [] and report["orphans_after_destroy"] == []
    # What the commands print, per job: its own instances and nobody else's.
    for mine, theirs in ((a, b), (b, a)):
        job_id = job_a if mine is a else job_b
        status = (work / "results" / job_id / "status.txt").read_text()
        cost = (work / "results" / job_id / "cost.txt").read_text()
        assert status.startswith(f"job {job_id} of stack SpotTrainingJobs") and cost.startswith(f"cost of job {job_id}")
        assert all(i in status for i in mine["instances"]) and not any(i in status for i in theirs["instances"])
    assert "Jobs drill report" in completed.stdout and "SpotTrainingJobs-JobB: !! spot interruption #1" in completed.stdout
    assert _processes_mentioning(str(work)) == []
