"""The CLI from a real (non-editable) wheel install: conf/ ships as `hydra_heads_conf`, and
`hydra-heads` composes and trains from a directory outside the checkout. The wheel ships every
package of the code except evaluation/benchmarks/ (scripts run by path from a checkout)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

CODE = ("train", "data_prep", "evaluation", "launch")
NOT_SHIPPED = {"evaluation.benchmarks"}  # scripts: `python evaluation/benchmarks/bench_*.py`

# Not part of the distribution: left out of the copy the wheel is built from, so that a stale
# build/ or egg-info of the checkout can neither leak into the wheel nor be written by the test.
SKIP = {
    ".git",
    ".venv",
    "build",
    "dist",
    "tests",
    "docs",
    "runs",
    "outputs",
    "multirun",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
}


def _ignore(_dir: str, names: list[str]) -> set[str]:
    return {n for n in names if n in SKIP or n.endswith((".egg-info", ".partial", ".pyc"))}


def _env() -> dict[str, str]:
    """A user's shell: no path tricks pointing back at the checkout, offline hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_HEADS_CONF")}
    env.pop("VIRTUAL_ENV", None)
    return {**env, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}


def _sh(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=_env(), timeout=timeout)
    assert r.returncode == 0, (
        f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of the checkout, built from a copy of it (pip builds in the source tree)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    shutil.copytree(REPO, src, ignore=_ignore)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root / "dist")]
    # Build with this environment's setuptools when it has one (nothing downloaded); a venv
    # without it (Python >= 3.12 makes those) fetches the build requirements from PyPI.
    if importlib.util.find_spec("setuptools") is not None:
        cmd.append("--no-build-isolation")
    _sh([*cmd, str(src)], cwd=root)
    (whl,) = (root / "dist").glob("hydra_heads-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (not editable). Its dependencies come from the
    test's own environment through a .pth line: a path a .pth file adds is not itself a site
    dir, so the .pth files in there (the checkout's editable-install finder) stay inactive."""
    root = tmp_path_factory.mktemp("venv")
    env = root / "venv"
    _sh([sys.executable, "-m", "venv", "--without-pip", str(env)], cwd=root)
    py = env / "bin" / "python"
    # This environment's pip installs into the new venv (pip >= 22.3: --python).
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q"]
    _sh([*pip, "--no-deps", "--no-index", str(wheel)], cwd=root)
    purelib = _sh([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], root)
    deps = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    deps = [p for p in deps if Path(p).is_dir()]
    (Path(purelib.stdout.strip()) / "_hydra_heads_test_deps.pth").write_text("\n".join(deps))
    return env


def test_pyproject_lists_every_package_but_the_benchmarks():
    """setuptools ships the packages pyproject.toml lists, no others: a new package that is
    not listed would be missing from the wheel (and a listed one that is gone fails the build)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for pkg in CODE
        for p in (REPO / pkg).rglob("__init__.py")
    }
    missing, gone = found - NOT_SHIPPED - listed, listed - {"hydra_heads_conf"} - found
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages"
    assert not listed & NOT_SHIPPED, "benchmarks are scripts of the checkout, not shipped"
    assert not gone, f"[tool.setuptools] packages lists {sorted(gone)}, which do not exist"


def test_wheel_ships_the_config_tree_and_scripts(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {
        "hydra_heads_conf/" + p.relative_to(REPO / "conf").as_posix()
        for p in (REPO / "conf").rglob("*")
        if p.is_file() and p.suffix in (".yaml", ".json")
    }
    want |= {p.relative_to(REPO).as_posix() for p in (REPO / "launch" / "slurm").glob("*.sh")}
    assert "hydra_heads_conf/train.yaml" in want
    assert not want - names, f"missing from {wheel.name}: {sorted(want - names)}"
    assert not [n for n in names if n.startswith("evaluation/benchmarks/")]
    assert "train/decoding/__init__.py" in names


def test_packages_import_from_the_wheel_not_the_checkout(venv, tmp_path):
    code = (
        "import json, train, data_prep, evaluation, launch, hydra_heads_conf;"
        "from train.core.config import conf_dir;"
        "mods = [train, data_prep, evaluation, launch, hydra_heads_conf];"
        "print(json.dumps({'files': [m.__file__ for m in mods], 'conf': str(conf_dir())}))"
    )
    r = _sh([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    own = venv.resolve()
    for f in [*res["files"], res["conf"]]:
        path = Path(f).resolve()
        assert path.is_relative_to(own), f"{f} is not from the wheel venv {own}"
        assert not path.is_relative_to(REPO.resolve()), f"{f} comes from the checkout"
    assert (Path(res["conf"]) / "train.yaml").is_file()


def test_cli_composes_config_outside_the_checkout(venv, tmp_path):
    cli = str(venv / "bin" / "hydra-heads")
    r = _sh([cli, "prep", "base=tiny_random", f"out={tmp_path / 'x'}", "--cfg", "job"], tmp_path)
    cfg = yaml.safe_load(r.stdout)
    assert cfg["base"]["source"] == "tiny_random"
    assert cfg["data"]["name"] == "sharegpt_bundled"


def test_cli_trains_outside_the_checkout(venv, tiny_prepared, tmp_path):
    cli = str(venv / "bin" / "hydra-heads")
    out = tmp_path / "run"
    args = ["head=hydra", f"data.prepared={tiny_prepared}", f"out={out}", "trainer.max_steps=2"]
    _sh([cli, "train", "base=tiny_random", *args, "logger=none"], cwd=tmp_path)
    assert (out / "heads" / "heads.safetensors").is_file()
    assert json.loads((out / "heads" / "heads_config.json").read_text())["training"]["steps"] == 2
    assert (out / "config.yaml").is_file()
    assert not (tmp_path / "outputs").exists()  # hydra wrote nothing into the working dir
