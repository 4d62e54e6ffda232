"""Every third-party distribution the code imports is declared in pyproject.toml.

The imports of train/, data_prep/, evaluation/ and launch/ (inside functions too, found with
`ast`) must come from the standard library, the project itself, or a distribution listed in
`[project] dependencies`; the tests may also use the `dev` extra (pytest, hypothesis, ...),
which the code never may. An import name is mapped to the distributions that install it with
`importlib.metadata.packages_distributions()` (`yaml` -> PyYAML), so the test sees the
environment it runs in: a name no installed distribution provides fails too.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Mapping
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CODE = ("train", "data_prep", "evaluation", "launch")
PROJECT = {*CODE, "tests", "hydra_heads_conf"}
BUILTIN = {"__main__", "__future__"}  # modules of every interpreter that no list names


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them: `PyYAML`, `pyyaml` -> `pyyaml`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    """`torch>=2.4,<2.15` -> `torch`; `huggingface-hub[cli]>=1` -> `huggingface-hub`."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    assert m, f"cannot read a distribution name from {spec!r}"
    return canonical(m.group(1))


def declared(extras: Iterable[str] = ()) -> set[str]:
    """The distributions pyproject.toml declares: `dependencies`, plus the named extras."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"]]
    for extra in extras:
        specs += project["optional-dependencies"][extra]
    return {requirement_name(s) for s in specs}


def top_level_imports(path: Path) -> dict[str, int]:
    """Top-level names of the absolute imports anywhere in the file -> first line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            found[top] = min(found.get(top, node.lineno), node.lineno)
    return found


def undeclared(
    files: Iterable[Path],
    allowed: set[str],
    dists_of: Mapping[str, list[str]],
    root: Path = REPO,
) -> list[str]:
    """'file:line imports X (distribution D), not declared' for every third-party import
    that no distribution in `allowed` provides."""
    bad = []
    for path in files:
        for top, line in sorted(top_level_imports(path).items()):
            if top in sys.stdlib_module_names or top in BUILTIN or top in PROJECT:
                continue
            where = f"{path.relative_to(root)}:{line} imports {top}"
            dists = sorted({canonical(d) for d in dists_of.get(top, [])})
            if not dists:
                bad.append(f"{where}, which no installed distribution provides")
            elif not set(dists) & allowed:
                bad.append(f"{where} (distribution {' or '.join(dists)}), not declared")
    return bad


def python_files(*dirs: str, root: Path = REPO) -> list[Path]:
    return sorted(p for d in dirs for p in (root / d).rglob("*.py"))


def test_the_code_imports_only_declared_dependencies():
    bad = undeclared(python_files(*CODE), declared(), packages_distributions())
    assert not bad, "add to [project] dependencies in pyproject.toml:\n" + "\n".join(bad)


def test_the_tests_import_only_declared_or_dev_dependencies():
    bad = undeclared(python_files("tests"), declared(["dev"]), packages_distributions())
    assert not bad, "add to the dev extra in pyproject.toml:\n" + "\n".join(bad)


def test_the_check_catches_an_undeclared_import(tmp_path):
    pkg = tmp_path / "train"
    pkg.mkdir()
    (pkg / "probe.py").write_text(
        "import os\nimport train.core\nfrom . import sibling\nimport torch.nn\n\n"
        "def f():\n    import yaml\n    import pytest\n    import no_such_module_anywhere\n"
    )
    files = python_files("train", root=tmp_path)
    dists = packages_distributions()
    code, dev = declared(), declared(["dev"])
    assert undeclared(files, code, dists, tmp_path) == [
        "train/probe.py:9 imports no_such_module_anywhere, which no installed distribution "
        "provides",
        "train/probe.py:8 imports pytest (distribution pytest), not declared",
    ]
    # a dev tool is fine in the tests, and an import name maps to its distribution
    assert undeclared(files, dev, dists, tmp_path) == [
        "train/probe.py:9 imports no_such_module_anywhere, which no installed distribution provides"
    ]
    assert undeclared(files, code - {"pyyaml"}, dists, tmp_path)[-1] == (
        "train/probe.py:7 imports yaml (distribution pyyaml), not declared"
    )
    assert requirement_name("huggingface_hub[cli]>=1.0") == "huggingface-hub"
