"""The Keras adapter's reused host buffers (through the driver): a background write always commits the state of its own
step, even when the next save copies (into the other buffer set) before the write has read its copy."""

from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).with_name("snapshot_job.py")


@pytest.mark.integration
def test_background_saves_commit_their_own_step_while_buffers_are_reused(tmp_path):
    out = subprocess.run([sys.executable, str(JOB), str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps_differ"], "the training steps changed no variable: the test could not catch a shared buffer"
    assert result["equal"] == {"1": True, "2": True, "3": True}, result
    first, second, third = result["buffer_ids"]
    assert first != second, "two saves in flight shared one host buffer set"
    assert third == first, "the third save did not reuse the first save's host buffers (written by then)"
