"""What the tests of root agents facing a hostile training user share (tests/agent/test_privilege.py,
tests/cluster/test_shared_state_safety.py): a directory tree with one part the training user owns and
one only root may read. Standard library only."""

from __future__ import annotations

import contextlib
import os
import pwd
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

TRAINING_USER = "nobody"


@contextlib.contextmanager
def training_user_tree(prefix: str, owned: str, user: str = TRAINING_USER) -> Iterator[Path]:
    """A directory under /tmp that ``user`` can traverse (pytest's tmp_path is 0700), holding ``owned/``
    (owned by ``user``, as a data volume or a cluster's EFS is) and ``secret/shadow`` (root only);
    removed on exit. Needs root."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(base, 0o755)
    account = pwd.getpwnam(user)
    (base / owned).mkdir()
    os.chown(base / owned, account.pw_uid, account.pw_gid)
    (base / "secret").mkdir(mode=0o700)
    (base / "secret" / "shadow").write_text("root:secret\n")
    os.chmod(base / "secret" / "shadow", 0o600)
    try:
        yield base
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=True)
