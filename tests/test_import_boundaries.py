"""The project's imports respect its layers (docs/architecture.md), checked statically by
walking every module's imports with `ast` (those inside functions too), and by importing the
decoding engine and evaluation in a fresh process.

Layers, low to high (a module's layer is that of the longest prefix below that names it):

    0  train.core              the shared kernel: base loading, config schemas, errors, I/O
    1  train.heads             one file per head architecture
    2  train.decoding          the one decoding engine: KV cache, acceptance rules, trees, proposal
    3  train, data_prep, evaluation   peers: the recipe, data preparation, evaluation
    4  launch                  the CLI and the launchers; every package's `__main__.py` too
    4  evaluation.benchmarks   standalone scripts that measure the peers, run by path

The rules, one test each:

1. Nothing imports upward.
2. Nothing imports sideways: two modules of one layer but of different packages (the peers
   `train` / `data_prep` / `evaluation`; at the top, `launch` and the benchmarks) never import
   each other; a peer uses only the layers below it.
3. No import cycles among the project's modules.
4. No module imports another module's `_private` name (`from x import _y`, or `x._y` on an
   imported project module).
5. Importing every module of train.heads, train.decoding or evaluation loads none of
   hydra-core, omegaconf, lightning, deepspeed or wandb; no package below the CLI loads optuna,
   submitit or wandb, and none but train/ lightning or deepspeed.
6. hydra-core is imported only where the layer table allows it: in layer 0 only inside
   `train.core.config.compose`, in the peers only by `train.recipe`, and anywhere in the CLI
   and the benchmarks.

Benchmarks: a benchmark measures one of the peers and so needs its code (bench_train.py times
the Lightning step of `train`, bench_prep.py the `data_prep` pipeline, bench_decode.py the
decoding engine as `evaluation` drives it). So in the layers they are not part of `evaluation`
but a top-layer component of their own, a peer of the CLI: they may import every layer up to 3
(the peers included), but not `launch` (sideways). They are scripts, run by path
(`python evaluation/benchmarks/bench_decode.py`) and not shipped in the wheel: nothing outside
them imports them, and nobody imports a `__main__` module either (it is run, `python -m
train`). The third-party rule (5) exempts benchmarks: timing the Lightning step loads Lightning.

Every project import also resolves to a module of the checkout (an import of a module that was
moved away fails here before it fails at run time).

Each rule is a function of one file (its path and module name) or of the module graph, so
`test_the_checks_catch_violations` plants violations in temporary files and runs the very
functions the real tests run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("train", "data_prep", "evaluation", "launch")
CLI = "launch"  # the component a package's `__main__` belongs to
# Module prefix -> layer; the longest matching prefix wins, and names the module's component.
LAYERS = {
    "train.core": 0,
    "train.heads": 1,
    "train.decoding": 2,
    "train": 3,
    "data_prep": 3,
    "evaluation": 3,
    "evaluation.benchmarks": 4,
    CLI: 4,
}
# Modules nothing imports: scripts run by path (not in the wheel).
SCRIPTS = ("evaluation.benchmarks",)
TRAINING_STACK = ("lightning", "pytorch_lightning", "hydra", "omegaconf", "deepspeed", "wandb")
CLI_ONLY = ("optuna", "submitit", "wandb")  # layer 4's (docs/architecture.md's table)
# Loaded by no module of the package, nor named in its imports; hydra-core's lazy import inside
# train.core.config.compose is rule 6's to check, so train.core and data_prep do not list it.
THIRD_PARTY = {
    "train.core": ("lightning", "pytorch_lightning", "deepspeed", *CLI_ONLY),
    "train.heads": (*TRAINING_STACK, *CLI_ONLY),
    "train.decoding": (*TRAINING_STACK, *CLI_ONLY),
    "train": CLI_ONLY,
    "evaluation": (*TRAINING_STACK, *CLI_ONLY),
    "data_prep": ("lightning", "pytorch_lightning", "deepspeed", *CLI_ONLY),
}

# -- reading a module's imports -----------------------------------------------------------------


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = REPO, packages: Collection[str] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py file of `packages` under `root`."""
    return {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def scoped_imports(path: Path) -> Iterator[tuple[str, str | None, int]]:
    """(absolute module imported, the outermost function or class it is imported in or None,
    line) for every absolute import of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

    def walk(node: ast.AST, scope: str | None) -> Iterator[tuple[str, str | None, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                yield from ((a.name, scope, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                yield child.module, scope, child.lineno
            inner = child.name if scope is None and isinstance(child, scopes) else scope
            yield from walk(child, inner)

    yield from walk(tree, None)


def imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in the file (inside functions too)."""
    return {module for module, _, _ in scoped_imports(path)}


def statements(path: Path, name: str) -> Iterator[tuple[str, str | None, int]]:
    """(module, name taken from it or None, line) for every import in the file, inside
    functions too; relative imports made absolute against module `name`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([module] if module else [])])
            for a in node.names:
                yield module, a.name, node.lineno


def target(module: str, taken: str | None, known: Collection[str]) -> str:
    """The module an import loads: `from pkg import sub` loads the submodule pkg.sub."""
    if taken is not None and f"{module}.{taken}" in known:
        return f"{module}.{taken}"
    return module


def is_project(module: str, known: Collection[str]) -> bool:
    return module.split(".")[0] in {k.split(".")[0] for k in known}


def project_targets(path: Path, name: str, known: Collection[str]) -> list[tuple[str, int]]:
    """(project module imported, line) for every project import of the file."""
    return [
        (t, line)
        for module, taken, line in statements(path, name)
        if is_project(t := target(module, taken, known), known)
    ]


# -- the layers ---------------------------------------------------------------------------------


def component(module: str) -> str | None:
    """The LAYERS prefix a module belongs to (a package's `__main__`: the CLI's)."""
    if module == "__main__" or module.endswith(".__main__"):
        return CLI
    hits = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return max(hits, key=len) if hits else None


def layer(module: str) -> int | None:
    comp = component(module)
    return None if comp is None else LAYERS[comp]


def upward_imports(path: Path, name: str, known: Collection[str]) -> list[str]:
    """Rule 1: imports of a higher layer than the module's own."""
    own = layer(name)
    return [
        f"{name}:{line} (layer {own}) imports {t} (layer {layer(t)})"
        for t, line in project_targets(path, name, known)
        if layer(t) is not None and own is not None and layer(t) > own
    ]


def sideways_imports(path: Path, name: str, known: Collection[str]) -> list[str]:
    """Rule 2: imports of another component of the same layer (e.g. train -> evaluation)."""
    own = component(name)
    return [
        f"{name}:{line} ({own}, layer {layer(name)}) imports {t} ({component(t)}, a peer)"
        for t, line in project_targets(path, name, known)
        if component(t) not in (None, own) and layer(t) == layer(name)
    ]


def script_imports(path: Path, name: str, known: Collection[str]) -> list[str]:
    """Scripts (benchmarks, `__main__` modules) are run, never imported."""
    return [
        f"{name}:{line} imports the script {t}"
        for t, line in project_targets(path, name, known)
        if t != name
        and (t.endswith(".__main__") or any(t == s or t.startswith(s + ".") for s in SCRIPTS))
        and not any(name == s or name.startswith(s + ".") for s in SCRIPTS)
    ]


def unresolved_imports(path: Path, name: str, known: Collection[str]) -> list[str]:
    """Project imports of modules the checkout does not have (moved, renamed, deleted)."""
    return [
        f"{name}:{line} imports {t}, which is not a module of the checkout"
        for t, line in project_targets(path, name, known)
        if t not in known
    ]


# -- cycles ---------------------------------------------------------------------------------------


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (function-level imports included)."""
    return {
        name: {t for t, _ in project_targets(path, name, modules) if t in modules and t != name}
        for name, path in modules.items()
    }


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (a deep import chain must not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    scc.add(m)
                    if m == node:
                        break
                out.append(scc)
    return out


def _shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest chain start -> ... -> start inside one strongly connected set."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & within):
                if child == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(parent[chain[-1]])
                    return [*reversed(chain), start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle")  # unreachable for a strongly connected set


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Rule 3: every import cycle, as chains [a, b, a]: the shortest one through each module of
    each strongly connected set of modules, duplicates removed."""
    cycles: dict[tuple[str, ...], list[str]] = {}
    for scc in _strongly_connected(graph):
        if len(scc) < 2:
            continue
        for start in sorted(scc):
            chain = _shortest_cycle(graph, start, scc)
            ring = chain[:-1]
            i = ring.index(min(ring))  # one key per cycle, whichever module it starts from
            cycles.setdefault(tuple(ring[i:] + ring[:i]), ring[i:] + ring[:i] + [ring[i]])
    return sorted(cycles.values())


# -- private names ------------------------------------------------------------------------------


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` -> 'a.b.c' for a chain of names; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_imports(path: Path, name: str, known: Collection[str]) -> list[str]:
    """Rule 4: `from x import _y`, or `x._y` on a name bound to project module x."""
    bad = []
    bound: dict[str, str] = {}  # local name -> the project module it refers to
    for module, taken, line in statements(path, name):
        if taken is None:  # `import a.b` binds a; `import a.b as m` binds m (to a.b)
            continue
        full = target(module, taken, known)
        if full != module:
            bound[taken] = full
        elif is_project(module, known) and module != name and _private(taken):
            bad.append(f"{name}:{line} imports {module}.{taken}, a private name")
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    bound[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.asname and a.name in bound:
                    bound[a.asname] = bound.pop(a.name)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        base = _dotted(node.value)
        if base is None or base.split(".")[0] not in bound:
            continue
        head, _, rest = base.partition(".")
        module = bound[head] + (f".{rest}" if rest else "")
        if module in known and module != name:
            bad.append(f"{name}:{node.lineno} uses {module}.{node.attr}, a private name")
    return bad


# -- hydra-core ---------------------------------------------------------------------------------

# Where hydra-core may be imported: module -> the one module-level function it may be imported
# in (None: anywhere in the module); the CLI's modules and the benchmarks may import it anywhere.
HYDRA_ALLOWED = {"train.core.config": "compose", "train.recipe": None}


def hydra_imports(path: Path, name: str, known: Collection[str]) -> list[str]:
    """Rule 6: imports of hydra-core outside the places the layer table allows."""
    if component(name) in (CLI, *SCRIPTS):
        return []
    return [
        f"{name}:{line} imports {module}"
        + (f" inside {scope}()" if scope else " at module level")
        + ", where the layers allow no hydra-core"
        for module, scope, line in scoped_imports(path)
        if module.split(".")[0] == "hydra"
        and not (name in HYDRA_ALLOWED and HYDRA_ALLOWED[name] in (None, scope))
    ]


# -- the tests ------------------------------------------------------------------------------------


def violations(rule) -> list[str]:
    modules = project_modules()
    return [line for name, path in modules.items() for line in rule(path, name, modules)]


def test_no_project_import_runs_up_the_layers():
    bad = violations(upward_imports)
    assert not bad, "\n".join(bad)


def test_no_peer_imports_another():
    bad = violations(sideways_imports)
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    cycles = import_cycles(import_graph(project_modules()))
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_a_private_name():
    bad = violations(private_imports)
    assert not bad, "\n".join(bad)


def test_nothing_imports_a_script():
    bad = violations(script_imports)
    assert not bad, "\n".join(bad)


def test_hydra_core_only_where_the_layers_allow():
    bad = violations(hydra_imports)
    assert not bad, "\n".join(bad)


def test_every_project_import_resolves():
    bad = violations(unresolved_imports)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", sorted(THIRD_PARTY))
def test_forbidden_third_party_imports(package):
    root = REPO / package.replace(".", "/")
    assert root.is_dir(), f"{package} moved: update THIRD_PARTY"
    forbidden = set(THIRD_PARTY[package])
    files = [p for p in sorted(root.rglob("*.py")) if "benchmarks" not in p.parts]
    bad = []
    for py in files:
        hits = {m.split(".")[0] for m in imports(py)} & forbidden
        if hits:
            bad.append(f"{py.relative_to(REPO)} imports {sorted(hits)}")
    assert not bad, "\n".join(bad)
    # and nothing it imports loads them either (a fresh interpreter, every module imported)
    modules = [module_name(p) for p in files if p.name != "__main__.py"]
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
    known = set(project_modules())
    # upward, sideways and script imports, one at the top and one inside a function
    f.write_text(
        "import os\nfrom lightning.pytorch import Trainer\nfrom evaluation import report\n\n"
        "def f():\n    import launch.cli\n    from evaluation.benchmarks import bench_decode\n"
    )
    assert "lightning.pytorch" in imports(f)
    assert upward_imports(f, "train.core.probe", known) == [
        "train.core.probe:3 (layer 0) imports evaluation.report (layer 3)",
        "train.core.probe:6 (layer 0) imports launch.cli (layer 4)",
        "train.core.probe:7 (layer 0) imports evaluation.benchmarks.bench_decode (layer 4)",
    ]
    assert upward_imports(f, "launch.probe", known) == []
    assert upward_imports(f, "train.__main__", known) == []  # `python -m train` is the CLI's
    assert sideways_imports(f, "train.probe", known) == [
        "train.probe:3 (train, layer 3) imports evaluation.report (evaluation, a peer)"
    ]
    assert sideways_imports(f, "data_prep.probe", known)[0].startswith("data_prep.probe:3 ")
    assert sideways_imports(f, "evaluation.probe", known) == []  # its own package
    assert sideways_imports(f, "evaluation.benchmarks.probe", known) == [  # a peer of the CLI
        "evaluation.benchmarks.probe:6 (evaluation.benchmarks, layer 4) imports launch.cli "
        "(launch, a peer)"
    ]
    assert script_imports(f, "launch.probe", known) == [
        "launch.probe:7 imports the script evaluation.benchmarks.bench_decode"
    ]
    assert script_imports(f, "evaluation.benchmarks.probe", known) == []
    assert layer("train.heads.hydra") == 1 and layer("train.decoding.tree") == 2
    assert layer("train.recipe") == 3 and layer("evaluation.benchmarks.bench_train") == 4
    assert layer("data_prep.__main__") == 4 and component("data_prep.__main__") == "launch"
    assert layer("torch") is None
    f.write_text("from train.core import no_such_module\nimport evaluation.gone\n")
    assert unresolved_imports(f, "train.probe", known) == [
        "train.probe:2 imports evaluation.gone, which is not a module of the checkout"
    ]  # `from train.core import x` may take a name: only the module part must resolve

    # private names: imported, or reached as an attribute of an imported project module
    f.write_text(
        "import torch\nimport train.core.config\nimport train.core.errors as errs\n"
        "from train.core import atomic as at\nfrom train.core.config import _hidden, __all__\n\n"
        "def f():\n    from . import _sibling\n    torch._dynamo, errs.__doc__\n"
        "    return train.core.config._x, errs._y, at._z\n"
    )
    assert private_imports(f, "train.probe", known) == [
        "train.probe:5 imports train.core.config._hidden, a private name",
        "train.probe:8 imports train._sibling, a private name",
        "train.probe:10 uses train.core.config._x, a private name",
        "train.probe:10 uses train.core.errors._y, a private name",
        "train.probe:10 uses train.core.atomic._z, a private name",
    ]

    # hydra-core: inside compose() only in layer 0, in train.recipe anywhere, in the CLI anywhere
    f.write_text(
        "import hydra\n\ndef compose():\n    from hydra import compose\n\n"
        "def load():\n    def inner():\n        from hydra.utils import instantiate\n"
    )
    assert hydra_imports(f, "train.core.config", known) == [
        "train.core.config:1 imports hydra at module level, where the layers allow no hydra-core",
        "train.core.config:8 imports hydra.utils inside load(), where the layers allow no "
        "hydra-core",
    ]
    assert len(hydra_imports(f, "train.core.base", known)) == 3  # not even inside compose()
    assert len(hydra_imports(f, "evaluation.probe", known)) == 3
    assert hydra_imports(f, "train.recipe", known) == []
    assert hydra_imports(f, "launch.probe", known) == []
    assert hydra_imports(f, "data_prep.__main__", known) == []

    # a two-module cycle, one side through `from pkg import module`, the other in a function
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    import pkg.a\n")
    (pkg / "c.py").write_text("import pkg.a\nfrom pkg.b import f\n")  # on no cycle
    graph = import_graph(project_modules(tmp_path, ["pkg"]))
    assert graph["pkg.c"] == {"pkg.a", "pkg.b"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    (pkg / "c.py").write_text("from pkg import a\n")
    (pkg / "b.py").write_text("import pkg.c\n")  # a three-module cycle now
    (pkg / "a.py").write_text("import pkg.b\n")
    assert import_cycles(import_graph(project_modules(tmp_path, ["pkg"]))) == [
        ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    ]
