"""The drills' one teardown (spot_training.local.deploy.destroy_and_check), in-process on a fake CDK CLI."""

from __future__ import annotations

from spot_training.local.deploy import destroy_and_check


class FakeCdk:
    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.calls = error, []

    def destroy(self, stack, *, context):
        self.calls.append((stack, dict(context)))
        if self.error is not None:
            raise self.error


def test_destroys_then_reports_what_the_orphan_check_found():
    cdk, events, report, order = FakeCdk(), [], {"phases_s": {}}, []
    left = ["i-0abc (instance)"]

    error = destroy_and_check(cdk, "SpotTraining", context={"k": "v"}, report=report, record=events.append,
                              before=lambda: order.append("before"),
                              orphans=lambda: order.append("orphans") or list(left))

    assert error is None
    assert cdk.calls == [("SpotTraining", {"k": "v"})]
    assert order == ["before", "orphans"]
    assert report["orphans_after_destroy"] == left
    assert report["phases_s"]["destroy"] >= 0
    assert [e["event"] for e in events] == ["phase", "destroyed"]
    assert events[1]["orphans"] == left


def test_a_failed_destroy_still_runs_the_orphan_check_and_returns_the_error():
    cdk, report = FakeCdk(RuntimeError("x" * 3000 + " stack DELETE_FAILED")), {"phases_s": {}}

    error = destroy_and_check(cdk, "SpotTraining", context={}, report=report, record=lambda event: None,
                              orphans=lambda: ["vol-0123 (volume)"])

    assert error is not None and error.endswith("stack DELETE_FAILED") and len(error) == 2000
    assert report["orphans_after_destroy"] == ["vol-0123 (volume)"]


def test_a_failing_before_step_skips_the_destroy_but_not_the_check():
    cdk, report = FakeCdk(), {"phases_s": {}}

    def before():
        raise OSError("bucket not empty")

    error = destroy_and_check(cdk, "S", context={}, report=report, record=lambda event: None, before=before,
                              orphans=lambda: [])

    assert error == "bucket not empty" and cdk.calls == []
    assert report["orphans_after_destroy"] == []
