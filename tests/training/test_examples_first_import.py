"""The examples users copy import ``spot_training.training.early_notice`` before anything else they import.

docs/training.md ("A notice in any phase") tells users to make it a script's first import: a SIGTERM while
NumPy and the framework load is then remembered instead of killing the process. A static check (:mod:`ast`,
no framework imported); ``tests/mxnet/test_gluon_early_notice.py`` shows the behaviour with a real signal.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "spot_training" / "training" / "examples"


def _imports(path: Path) -> list[str]:
    # module-level imports in source order, leaving out the standard library and ``from __future__``
    names = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] not in sys.stdlib_module_names and n != "__future__"]


@pytest.mark.parametrize("example", ["gluon_resnet.py", "keras_resnet.py", "torch_resnet.py"])
def test_early_notice_is_the_first_import_after_the_standard_library(example: str) -> None:
    imports = _imports(EXAMPLES / example)
    assert imports[:1] == ["spot_training.training.early_notice"], imports
