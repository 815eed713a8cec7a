"""``spot-train logs`` prints what the trainer wrote; terminal control sequences in it must not reach
the operator's terminal (colour changes, cursor moves that hide lines, title/clipboard writes), and a
line must not fake another. In-process: format_log_line on crafted events."""

from __future__ import annotations

import json

import pytest

from spot_training.ops.operations import format_log_line, strip_control

EVENT = {"timestamp": 1_700_000_000_000, "instance_id": "i-0abc"}


@pytest.mark.parametrize("hostile", [
    "\x1b[31mred\x1b[0m", "\x1b]0;owned title\x07", "\x1b]52;c;ZWNobyBoaQ==\x07", "\x1b[2J\x1b[H",
    "\x1b[1A\x1b[2K", "\x9b31m", "\x1bP+q\x1b\\", "\x07\x08\x0c", "\x1bc",
])
def test_trainer_output_control_sequences_are_stripped(hostile):
    line = format_log_line({**EVENT, "message": json.dumps({"logger": "trainer", "message": f"step 1 {hostile} done"})})
    assert not any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f for c in line), repr(line)
    assert line.endswith("done") and "step 1" in line


def test_a_newline_cannot_fake_a_second_log_line():
    line = format_log_line({**EVENT, "message": "ok\n00:00:00.000 i-0other agent ERRO fake"})
    assert "\n" not in line and "ok\\n00:00:00.000" in line


def test_plain_text_and_tabs_are_kept():
    assert strip_control("loss=0.25\tacc=0.9 ümlaut") == "loss=0.25\tacc=0.9 ümlaut"
