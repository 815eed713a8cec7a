"""Every public name in ``spot_training`` and ``bench`` has a Google-style docstring (the team's guide, "Docstrings").

A static check with :mod:`ast` (no import, so it runs in the unit tier in well under a second):

- a public function, method or class (its name and its module's have no leading underscore) has a docstring;
- a public function or method that takes two or more parameters besides ``self``/``cls`` documents them in
  an ``Args:`` section. A class's ``__init__`` may leave its ``Args:`` to the class docstring (Google style
  allows either).

A function that implements a documented protocol may leave its ``Args:`` to it: its docstring has a line
``Implements :meth:`module.Class.method`.``, where ``Class.method`` in ``module`` (a file of this repository) has
an ``Args:`` section and the same parameters. Any other such reference (a missing target, a target without
``Args:``, other parameters) is reported, and a protocol named in passing does not count.

Nested functions (closures) are not public and are not checked. :data:`PACKAGES` lists the parts of
``spot_training`` the check covers; :data:`ALLOWED` the names it lets pass, each with the reason.

Code and comments give reasons, not tracker numbers: no ``issue N`` in ``spot_training``, ``bench`` or
``tests`` (a reference to another project's issue, such as ``pytorch/pytorch issue 100974``, is a
source and passes).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: The parts of the repository (directories or single modules) checked: the library and the benchmarks.
PACKAGES = ("spot_training", "bench")
#: ``"path:qualified.name"`` -> why it may lack a docstring or an ``Args:`` section.
ALLOWED: dict[str, str] = {}


def _is_private_module(path: Path) -> bool:
    return any(part.startswith("_") and part != "__init__.py" for part in path.parts)


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    return [n for n in names if n not in ("self", "cls")]


def _is_setter(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    # ``@name.setter``/``@name.deleter`` share the property's docstring; ``@overload`` stubs the real one's.
    for dec in node.decorator_list:
        if isinstance(dec, ast.Attribute) and dec.attr in ("setter", "deleter"):
            return True
        if isinstance(dec, ast.Name) and dec.id == "overload":
            return True
    return False


#: ``Implements :meth:`pkg.module.Class.method`.`` at the start of a docstring line.
_IMPLEMENTS = re.compile(r"^\s*Implements :meth:`([\w.]+)\.(\w+)\.(\w+)`", re.MULTILINE)


def _repo_source(module: str) -> str | None:
    path = REPO / Path(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
    return None


def _protocol_problem(node: ast.FunctionDef | ast.AsyncFunctionDef, doc: str, sources) -> str | None:
    # None when ``doc`` names a protocol method with an Args: section and ``node``'s parameters; else the problem.
    match = _IMPLEMENTS.search(doc)
    if match is None:
        return f"{len(_params(node))} parameters and no Args:"
    module, cls, method = match.groups()
    source = sources(module)
    target = None
    for top in ast.parse(source).body if source is not None else []:
        if isinstance(top, ast.ClassDef) and top.name == cls:
            target = next((n for n in top.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and n.name == method), None)
    reference = f"{module}.{cls}.{method}"
    if target is None:
        return f"implements {reference}, which does not exist"
    if "Args:" not in (ast.get_docstring(target) or ""):
        return f"implements {reference}, which has no Args:"
    if _params(target) != _params(node):
        return f"implements {reference}, whose parameters are {_params(target)}, not {_params(node)}"
    return None


def problems(source: str, label: str, sources=_repo_source) -> list[str]:
    """The style problems in one module's source.

    Args:
        source: the module's Python source text.
        label: the module's path as it appears in the messages (and in :data:`ALLOWED` keys).
        sources: ``module name -> its source text, or None``: where a protocol that a docstring says it
            implements is looked up (default: the repository's files).

    Returns:
        one ``"label:line qualified.name: what is missing"`` line per problem, in source order.
    """
    found: list[str] = []

    def visit(body: list[ast.stmt], prefix: str, class_doc: str | None) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            name = prefix + node.name
            if node.name.startswith("_") and node.name != "__init__":
                continue
            doc = ast.get_docstring(node)
            where = f"{label}:{node.lineno} {name}"
            if isinstance(node, ast.ClassDef):
                if not doc:
                    found.append(f"{where}: no docstring")
                visit(node.body, name + ".", doc)
                continue
            if _is_setter(node):
                continue
            if node.name == "__init__":
                # Google style: the constructor's arguments go in the class docstring or in __init__'s.
                if len(_params(node)) >= 2 and "Args:" not in (doc or "") and "Args:" not in (class_doc or ""):
                    found.append(f"{where}: {len(_params(node))} parameters and no Args: (class or __init__)")
                continue
            if not doc:
                found.append(f"{where}: no docstring")
            elif len(_params(node)) >= 2 and "Args:" not in doc:
                problem = _protocol_problem(node, doc, sources)
                if problem:
                    found.append(f"{where}: {problem}")

    visit(ast.parse(source).body, "", None)
    return found


def _modules() -> list[Path]:
    paths: list[Path] = []
    for entry in PACKAGES:
        target = REPO / entry
        paths += [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))
    return [p for p in paths if not _is_private_module(p.relative_to(REPO))]


def test_every_public_name_has_a_google_style_docstring() -> None:
    missing = []
    for path in _modules():
        label = str(path.relative_to(REPO))
        for line in problems(path.read_text(encoding="utf-8"), label):
            key = line.split(" ", 1)[0].split(":")[0] + ":" + line.split(" ", 2)[1].rstrip(":")
            if key not in ALLOWED:
                missing.append(line)
    assert not missing, f"{len(missing)} public names lack a docstring or its Args: section:\n" + "\n".join(missing)


#: ``issue 15``, ``issue #15``, ``Issue 15`` ...; a line naming ``owner/repo issue N`` (another project's
#: tracker) passes.
_ISSUE_REFERENCE = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)


def issue_references(text: str, label: str) -> list[str]:
    """``label:line: text`` of every line of ``text`` that names one of this project's issues by number.

    Args:
        text: a module's source.
        label: its path, for the messages.

    Returns:
        one entry per offending line.
    """
    return [f"{label}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if _ISSUE_REFERENCE.search(line) and not re.search(r"[\w.-]+/[\w.-]+ issues? #?\d+", line)]


def test_code_gives_reasons_not_issue_numbers() -> None:
    found = []
    paths = _modules() + sorted((REPO / "tests").rglob("*.py"))
    for path in paths:
        if path.resolve() == Path(__file__).resolve():  # its own examples name issues on purpose
            continue
        found += issue_references(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert not found, "replace each issue reference by the reason it stood for:\n" + "\n".join(found)


@pytest.mark.parametrize(("line", "flagged"), [
    ("# the lease (issue 15, item 4)", True),
    ("x = 1  # see Issue #7", True),
    ("#: dependencies (pytorch/pytorch issue 100974), so no extra index", False),
    ("an issue with the network", False),
])
def test_the_issue_check_tells_references_from_sources(line: str, flagged: bool) -> None:
    assert bool(issue_references(line, "m.py")) is flagged


def test_allow_list_entries_still_exist_and_say_why() -> None:
    for key, reason in ALLOWED.items():
        path, _, _name = key.partition(":")
        assert (REPO / path).is_file(), f"{key}: no such module"
        assert reason.strip(), f"{key}: an allow-list entry needs its reason"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(a, b):\n    'Sum.'\n", ["m.py:1 f: 2 parameters and no Args:"]),
        ("def f(a):\n    pass\n", ["m.py:1 f: no docstring"]),
        ("class C:\n    def m(self, a, b):\n        'M.'\n",
         ["m.py:1 C: no docstring", "m.py:2 C.m: 2 parameters and no Args:"]),
        ("class C:\n    'C.'\n    def __init__(self, a, b):\n        pass\n",
         ["m.py:3 C.__init__: 2 parameters and no Args: (class or __init__)"]),
    ],
)
def test_the_check_finds_missing_docstrings(source: str, expected: list[str]) -> None:
    assert problems(source, "m.py") == expected


@pytest.mark.parametrize(
    "source",
    [
        "def f(a, b):\n    '''Sum.\n\n    Args:\n        a: one.\n        b: two.\n    '''\n",
        "def _f(a, b):\n    pass\n",
        "def f(self):\n    'One.'\n",
        "class C:\n    '''C.\n\n    Args:\n        a: one.\n        b: two.\n    '''\n"
        "    def __init__(self, a, b):\n        pass\n",
        "def f():\n    'F.'\n    def inner(a, b):\n        pass\n",
    ],
)
def test_the_check_passes_documented_and_private_names(source: str) -> None:
    assert problems(source, "m.py") == []


#: A protocol module for the ``Implements`` cases: ``P.run`` documents its Args, ``P.bare`` does not.
_PROTOCOL = '''
class P:
    def run(self, a, *, b):
        """Run.

        Args:
            a: one.
            b: two.
        """

    def bare(self, a, b):
        """Bare."""
'''


def _implementing(name: str, params: str, reference: str) -> str:
    return f'def {name}({params}):\n    """Run.\n\n    Implements :meth:`{reference}`.\n    """\n'


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (_implementing("run", "a, *, b", "proto.P.run"), []),
        # the protocol named in passing, not on a line of its own: an undocumented function as before
        ('def run(a, *, b):\n    """Run, like :meth:`proto.P.run`."""\n', ["m.py:1 run: 2 parameters and no Args:"]),
        (_implementing("run", "a, *, b", "proto.P.gone"), ["m.py:1 run: implements proto.P.gone, which does not exist"]),
        (_implementing("run", "a, *, b", "nowhere.P.run"),
         ["m.py:1 run: implements nowhere.P.run, which does not exist"]),
        (_implementing("bare", "a, b", "proto.P.bare"), ["m.py:1 bare: implements proto.P.bare, which has no Args:"]),
        (_implementing("run", "a, c", "proto.P.run"),
         ["m.py:1 run: implements proto.P.run, whose parameters are ['a', 'b'], not ['a', 'c']"]),
    ],
)
def test_a_function_may_leave_its_args_to_the_protocol_it_implements(source: str, expected: list[str]) -> None:
    assert problems(source, "m.py", {"proto": _PROTOCOL}.get) == expected


def test_the_notice_drill_protocol_resolves_in_the_repository() -> None:
    # the real target: bench/notice/common.py's FrontEnd.trial, with its Args: and the four parameters
    assert problems(_implementing("trial", "root, ctx, *, phase, rng", "bench.notice.common.FrontEnd.trial"),
                    "m.py") == []
