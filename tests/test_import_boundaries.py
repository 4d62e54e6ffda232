"""Imports respect the layers (DESIGN.md): the shared core, then the heads, then data /
training / decoding and evaluation, then the CLI and launchers; nothing imports upward.
evaluation/ never loads lightning, hydra-core, deepspeed or wandb, train/heads/ never loads
lightning (checked statically per file, and by importing the package in a fresh process).

evaluation/benchmarks/ holds standalone scripts: a benchmark of the Lightning training step has
to import Lightning, so the third-party rule exempts them; the layers do not (no `launch`).
A package's `__main__.py` (`python -m train`, DESIGN.md) is run, never imported: it is an entry
point of the CLI layer.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("train", "data_prep", "evaluation", "launch")
# Module prefix -> layer; the longest matching prefix wins. Same-layer imports are allowed.
LAYERS = {
    "train.core": 0,
    "train.heads": 1,
    "train": 2,
    "data_prep": 2,
    "evaluation": 2,
    "launch": 3,
}
THIRD_PARTY = {
    "evaluation": ("lightning", "pytorch_lightning", "hydra", "omegaconf", "deepspeed", "wandb"),
    "train.heads": ("lightning", "pytorch_lightning"),
    "data_prep": ("lightning", "pytorch_lightning", "deepspeed", "wandb"),
}


def layer(module: str) -> int | None:
    if module.endswith(".__main__"):  # `python -m <package>`: an entry point nothing imports
        return LAYERS["launch"]
    hits = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(hits, key=len)] if hits else None


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in the file (inside functions too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def upward_imports(path: Path, name: str | None = None) -> list[str]:
    """`path`'s imports of a higher layer than its own (`name`: its module, default by path)."""
    name = name or module_name(path)
    own = layer(name)
    return [
        f"{name} (layer {own}) imports {m} (layer {layer(m)})"
        for m in sorted(imports(path))
        if layer(m) is not None and layer(m) > own
    ]


def test_no_project_import_runs_up_the_layers():
    bad = [line for path in sources() for line in upward_imports(path)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", sorted(THIRD_PARTY))
def test_forbidden_third_party_imports(package):
    forbidden = set(THIRD_PARTY[package])
    bad = []
    for py in sorted((REPO / package.replace(".", "/")).rglob("*.py")):
        if "benchmarks" in py.relative_to(REPO).parts:
            continue
        hits = {m.split(".")[0] for m in imports(py)} & forbidden
        if hits:
            bad.append(f"{py.relative_to(REPO)} imports {sorted(hits)}")
    assert not bad, "\n".join(bad)
    # and nothing it imports loads them either (a fresh interpreter, every module imported)
    modules = [
        module_name(p)
        for p in sorted((REPO / package.replace(".", "/")).rglob("*.py"))
        if "benchmarks" not in p.parts and p.name != "__main__.py"
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted({{n.split('.')[0] for n in sys.modules}} & set({sorted(forbidden)!r})))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"importing {package} loads {r.stdout.strip()}"


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers.py (functions) and conftest.py (fixtures)."""
    bad = [
        f"{p.relative_to(REPO)} imports {m}"
        for p in sorted((REPO / "tests").rglob("*.py"))
        for m in sorted(imports(p))
        if m.startswith("tests.") and m.rsplit(".", 1)[-1].startswith(("test_", "conftest"))
    ]
    assert not bad, "\n".join(bad)


def test_the_checks_catch_violations(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text(
        "import os\nfrom lightning.pytorch import Trainer\n\ndef f():\n    import launch.cli\n"
    )
    assert "lightning.pytorch" in imports(f)
    assert upward_imports(f, "train.core.probe") == [
        "train.core.probe (layer 0) imports launch.cli (layer 3)"
    ]
    assert upward_imports(f, "launch.probe") == []
    assert upward_imports(f, "train.__main__") == []  # `python -m train` is the CLI's
    assert layer("train.heads.hydra") == 1 and layer("train.recipe") == 2
    assert layer("evaluation.benchmarks.bench_train") == 2 and layer("torch") is None
