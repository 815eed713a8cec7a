"""The README is the user's manual: it must name every context key with its default, the two
commands, and the picture it shows must exist. Nothing here imports TensorFlow or MXNet."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _context_keys() -> dict[str, object]:
    context = json.loads((ROOT / "cdk.json").read_text(encoding="utf-8"))["context"]
    return {key: value for key, value in context.items() if not key.startswith("@")}


def _readme_rows() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in README.splitlines():
        match = re.match(r"\| `([a-z_]+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def _rendered_default(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(str(item) for item in value)
    return str(value)


def test_every_context_key_is_documented_with_its_cdk_json_default() -> None:
    rows = _readme_rows()
    keys = _context_keys()
    assert keys, "cdk.json has no context keys"
    missing = sorted(set(keys) - set(rows))
    assert not missing, f"README.md documents no row for context keys {missing}"
    wrong = {
        key: (rows[key][0], _rendered_default(value))
        for key, value in keys.items()
        if rows[key][0].strip("`") != _rendered_default(value)
    }
    assert not wrong, f"README.md default differs from cdk.json (README, cdk.json): {wrong}"


def test_readme_rows_are_real_context_keys() -> None:
    stale = sorted(set(_readme_rows()) - set(_context_keys()))
    assert not stale, f"README.md documents context keys that cdk.json does not have: {stale}"


def test_the_two_commands_and_the_ci_entry_point_agree() -> None:
    assert "make demo" in README and "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo: setup$", makefile, re.M) and re.search(r"^test: setup$", makefile, re.M)


def test_every_local_link_and_image_in_the_readme_exists() -> None:
    targets = re.findall(r"\]\(((?:docs|bench|training|infra|bootstrap|localmode)/[^)#]+)\)", README)
    assert targets, "README.md links to nothing under docs/"
    absent = [target for target in targets if not (ROOT / target).exists()]
    assert not absent, f"README.md links to missing files: {absent}"
