"""The node code runs on the Deep Learning AMI's Python 3.10 (its release notes: ``/usr/bin/python3.10``).

``vermin`` (a static analyser of the minimum Python version a file needs) checks every module that runs
on a node: the contract between the layers (``spot_training/contract/``), the agent (``spot_training/agent/``), the training library (``spot_training/training/``, run by the AMI's interpreter
or a venv of it), and the local wheel writer local mode's nodes use.
"""

from __future__ import annotations

import pytest

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NODE_CODE = ("spot_training/contract", "spot_training/agent", "spot_training/training")
#: The oldest Python the node code must run on.
TARGET = "3.10"


def _vermin(*paths: str | Path) -> subprocess.CompletedProcess:
    # vermin has no ``__main__``: run its console script from this interpreter's environment.
    vermin = Path(sys.executable).parent / "vermin"
    return subprocess.run([str(vermin), f"-t={TARGET}-", "--violations", "--no-tips",
                           "--eval-annotations", "--no-parse-comments", *map(str, paths)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.integration
def test_node_code_runs_on_python_3_10() -> None:
    done = _vermin(*NODE_CODE)
    assert done.returncode == 0, f"node code needs a Python newer than {TARGET}:\n{done.stdout}{done.stderr}"


@pytest.mark.integration
def test_the_check_catches_code_that_needs_3_11(tmp_path: Path) -> None:
    (tmp_path / "new.py").write_text("import tomllib\n\ntry:\n    pass\nexcept* ValueError:\n    pass\n")
    done = _vermin(tmp_path / "new.py")
    assert done.returncode != 0 and "tomllib" in done.stdout
