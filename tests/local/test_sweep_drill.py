"""The sweep drill end to end: `spot-train local drill --sweep` deploys SpotSweep with the real CDK CLI to
the moto server, runs 8 children on local AWS Batch through reclaims and a code error, destroys."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_drill import _processes_mentioning, run_drill_cli


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sweep_drill_survives_reclaims_and_fails_a_code_error_fast(tmp_path: Path) -> None:
    work = tmp_path / "sweep-drill"
    completed, report = run_drill_cli(work, "--sweep", timeout=850)
    assert completed.returncode == 0, (report.get("error"), completed.stdout[-3000:])
    assert report["passed"] is True

    children = {c["index"]: c for c in report["children"]}
    assert len(children) >= 8
    code_error = children[report["code_error_index"]]
    assert code_error["state"] == "FAILED" and code_error["attempts"] == 1 and code_error["reclaims"] == 0
    reclaimed = [c for c in children.values() if c["reclaims"] >= 1]
    assert len(reclaimed) >= 3 and any(c["reclaims"] == 2 and c["attempts"] == 3 for c in reclaimed)
    for child in children.values():
        if child["index"] == report["code_error_index"]:
            continue
        assert child["state"] == "SUCCEEDED" and child["step"] == child["total_steps"] == report["options"]["steps"]
        assert child["lost_steps"] == 0 and child["noticed_reclaims"] == child["reclaims"]
        assert len(child["attempt_costs_usd"]) == child["attempts"] and all(c > 0 for c in child["attempt_costs_usd"])
    assert sum(1 for c in children.values() if c.get("matches_uninterrupted_run") is True) == 2
    assert report["best"][0]["accuracy"] == max(c["accuracy"] for c in children.values() if c["accuracy"] is not None)
    assert report["orphans_after_destroy"] == []
    assert _processes_mentioning(str(work)) == []
