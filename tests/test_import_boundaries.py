"""evaluation/ never imports lightning, hydra-core, deepspeed or wandb; train/heads/ never
imports lightning (DESIGN.md). Checked statically over every module's import statements.

evaluation/benchmarks/ holds standalone scripts, not library code that evaluation imports: a
benchmark of the Lightning training step has to import Lightning, so those scripts are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RULES = {
    "evaluation": ("lightning", "pytorch_lightning", "hydra", "omegaconf", "deepspeed", "wandb"),
    "train/heads": ("lightning", "pytorch_lightning"),
    "data_prep": ("lightning", "pytorch_lightning", "deepspeed", "wandb"),
}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(RULES))
def test_forbidden_imports(package):
    root = REPO / package
    if not root.exists():
        pytest.skip(f"{package} does not exist yet")
    bad = []
    for py in sorted(root.rglob("*.py")):
        if "benchmarks" in py.relative_to(REPO).parts:
            continue
        hits = imported_roots(py) & set(RULES[package])
        if hits:
            bad.append(f"{py.relative_to(REPO)} imports {sorted(hits)}")
    assert not bad, "\n".join(bad)


def test_checker_catches_a_forbidden_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom lightning.pytorch import Trainer\n")
    assert "lightning" in imported_roots(f)
