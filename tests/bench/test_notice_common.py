"""bench/notice/common.py's reference run: made once, on first use, and a failed one is an error naming it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.notice.common import reference  # noqa: E402


def test_the_reference_run_runs_once_on_first_use(tmp_path):
    calls = []

    def run(path: Path) -> bool:
        calls.append(path)
        path.write_bytes(b"state")
        return True

    path = tmp_path / "reference" / "final.npz"
    assert reference(path, run) == path
    assert reference(path, run) == path
    assert calls == [path]


def test_a_failed_reference_run_is_an_error_naming_its_path(tmp_path):
    path = tmp_path / "reference" / "final.npz"
    with pytest.raises(RuntimeError, match=str(path)):
        reference(path, lambda _path: False)
