"""A small local git repository for the code-fetching tests (tests/agent/test_supervisor.py and
test_privilege.py): a stand-in for the https URL a real node clones."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git(*args: str, cwd: Path) -> str:
    """Run ``git args`` in ``cwd`` with a fixed author; its stdout, stripped. CalledProcessError on failure."""
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com")
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def two_version_repo(base: Path, files: dict[str, str] | None = None) -> tuple[Path, str]:
    """``base/repo``: a first commit (``files`` and VERSION "1") tagged v1, a second (VERSION "2") tagged
    v2. Returns (the repository's path, the v2 commit)."""
    repo = base / "repo"
    repo.mkdir()
    git("init", "-q", cwd=repo)
    for name, text in (files or {}).items():
        (repo / name).write_text(text)
    (repo / "VERSION").write_text("1")
    git("add", ".", cwd=repo)
    git("commit", "-q", "-m", "v1", cwd=repo)
    git("tag", "v1", cwd=repo)
    (repo / "VERSION").write_text("2")
    git("commit", "-q", "-am", "v2", cwd=repo)
    git("tag", "v2", cwd=repo)
    return repo, git("rev-parse", "v2", cwd=repo)
