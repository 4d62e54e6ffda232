"""The docs stay true to the code: every `hydra-heads` command they show is one the CLI
accepts, and every link, anchor and file path they name exists.

Users copy commands from README.md, docs/*.md, the Makefile and the comments in conf/. Each one
found there is composed from conf/ and validated by its subcommand's schema, as the CLI would do
before any work, so a renamed key, a removed option, a bad value or a required key left out fails
here instead of in a user's shell. The conventions it reads (placeholders, alternatives, partial
commands, documented failures) are in docs/architecture.md, "Docs".
"""

from __future__ import annotations

import importlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import group_options
from train.core.config import compose, conf_dir, load

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = {
    "prep": ("launch.commands.prep", "data_prep.config", "PrepConfig"),
    "train": ("launch.commands.train", "train.config", "TrainConfig"),
    "eval": ("launch.commands.eval", "evaluation.config", "EvalConfig"),
    "report": ("launch.commands.report", "evaluation.config", "ReportConfig"),
    "sweep": ("launch.commands.sweep", "launch.config", "SweepConfig"),
    "export": ("launch.commands.export", "launch.config", "ExportConfig"),
    "import": ("launch.commands.import_heads", "launch.config", "ImportConfig"),
    "launch": ("launch.commands.launch", "launch.config", "LaunchConfig"),
    "plan": ("launch.commands.plan", "launch.config", "PlanConfig"),
}
SHELL_STOP = {"|", "||", "&&", ";", "&", "2>&1"}
PLACEHOLDER = re.compile(r"^([A-Z][A-Z0-9_]*([./][\w./-]*)?|\.\.\.)$")
COMMAND = re.compile(r"hydra-heads\s+(\S.*)")
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Documented:
    where: str  # file and line
    argv: list[str]  # subcommand and its arguments, as written
    complete: bool  # required keys must all be given
    error: str | None = None  # the documented error message, for a documented failure


def _tokens(text: str) -> list[str]:
    """The command's arguments: shell words up to a shell operator, a redirection, a comment or
    prose (a word starting with `(`, or ending in a closing backtick)."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in prose
        words = text.split()
    out: list[str] = []
    for w in words:
        if w in SHELL_STOP or w.startswith((">", "(")):
            break
        if w.endswith("`"):
            out.append(w.rstrip("`"))
            break
        out.append(w)
    return out


def _add(found: list[Documented], where: str, text: str, in_block: bool, error=None) -> None:
    for m in COMMAND.finditer(text):
        argv = _tokens(m.group(1))
        if not argv or argv[0] not in SCHEMAS:
            continue  # prose: "`hydra-heads`", "hydra-heads' CLI"
        overrides = [a for a in argv[1:] if "=" in a]
        if not overrides and not in_block:
            continue  # a mention of the subcommand in prose: `hydra-heads report`
        # `--help` and `--cfg job` show things and run nothing: no key is required
        partial = any("..." in a or "<" in a or a in ("--help", "-h", "--cfg") for a in argv)
        complete = not partial and (in_block or len(overrides) >= 3)
        found.append(Documented(where, argv, complete, error))


def _joined(lines: list[str]):
    """(first index, last index, text) of each line, a shell line continued by a trailing `\\`
    joined with the lines it continues onto."""
    i = 0
    while i < len(lines):
        start, text = i, lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i]
        yield start, i, text
        i += 1


def _markdown(path: Path, found: list[Documented]) -> None:
    text = path.read_text()
    name = path.relative_to(ROOT)
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
    for block in fence.finditer(text):
        line0 = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).split("\n")
        for start, end, line in _joined(lines):
            nxt = lines[end + 1] if end + 1 < len(lines) else ""
            error = None
            if line.startswith("$ ") and nxt.startswith("error: "):
                error = nxt[len("error: ") :].strip()
            _add(found, f"{name}:{line0 + start}", line, True, error)
    prose = fence.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in re.finditer(r"`([^`]+)`", prose):
        line = prose.count("\n", 0, span.start()) + 1  # fences kept their newlines
        _add(found, f"{name}:{line}", span.group(1).replace("\n", " "), False)


def _yaml_comments(path: Path, found: list[Documented]) -> None:
    name = path.relative_to(ROOT)
    lines = path.read_text().split("\n")
    comments = [(i, line.split("#", 1)[1]) for i, line in enumerate(lines) if "#" in line]
    for start, _, text in _joined([c for _, c in comments]):
        n = comments[start][0]
        spans = re.findall(r"`([^`]+)`", text)
        for span in spans:
            _add(found, f"{name}:{n + 1}", span, False)
        if not spans and text.strip().startswith("hydra-heads"):
            _add(found, f"{name}:{n + 1}", text, True)


def _makefile(path: Path, found: list[Documented]) -> None:
    text = path.read_text()
    variables = dict(re.findall(r"^(\w+)\s*[:?]?=\s*(.*)$", text, re.M))
    for n, line in enumerate(text.split("\n"), 1):
        if "hydra-heads " not in line or line.lstrip().startswith("#"):
            continue
        for _ in range(3):  # variables that name variables
            line = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), line)
        _add(found, f"Makefile:{n}", line, True)


def documented() -> list[Documented]:
    found: list[Documented] = []
    for path in MARKDOWN:
        _markdown(path, found)
    for path in sorted(conf_dir().rglob("*.yaml")):
        _yaml_comments(path, found)
    _makefile(ROOT / "Makefile", found)
    return found


def _variants(argv: list[str]) -> list[list[str]]:
    """The overrides to check: flags dropped, `[k=v]` unwrapped, alternatives expanded."""
    multirun = "-m" in argv or "--multirun" in argv
    args, skip = [], False
    for a in argv[1:]:
        if skip:
            skip = False
            continue
        if a in ("--cfg", "-c", "--package", "-p"):
            skip = True  # the flag's value
            continue
        if a.startswith("-") or a == "..." or "<" in a:
            continue
        if a.startswith("[") and a.endswith("]") and "=" in a and a.index("=") > 1:
            a = a[1:-1]
        if "=" in a:
            args.append(a)
    variants = [[]]
    for a in args:
        key, value = a.split("=", 1)
        alternatives = [value]
        if "|" in value and not value.startswith(("[", "{", "'", '"')):
            alternatives = value.split("|")
        elif multirun and "," in value and not value.startswith(("[", "{")):
            alternatives = value.split(",")
        variants = [[*v, f"{key}={alt}"] for v in variants for alt in alternatives]
    return variants


def _check(doc: Documented, overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    command, module, cls = SCHEMAS[doc.argv[0]]
    schema = getattr(importlib.import_module(module), cls)
    config_name = importlib.import_module(command).CONFIG_NAME
    given, placeholders = [], []
    for o in overrides:
        key, value = o.split("=", 1)
        (placeholders if PLACEHOLDER.match(value) else given).append((key, value))
    groups = {p.name for p in conf_dir().iterdir() if p.is_dir()}
    for key, _ in placeholders:  # a group placeholder (base=NAME): check with one of its options
        if key.lstrip("+") in groups:
            given.append((key, group_options(key.lstrip("+"))[0]))
    cfg = compose(config_name, [f"{k}={v}" for k, v in given])
    plain = OmegaConf.to_container(cfg, resolve=False)
    missing = set(_missing_keys(plain))
    for key, _ in placeholders:
        if key.startswith("+"):  # a key the command adds: nothing to find
            continue
        key = key.lstrip("~")
        if key in groups:
            continue
        *parents, last = key.split(".")
        node = plain
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        assert isinstance(node, dict) and last in node, (
            f"{doc.where}: {' '.join(doc.argv)}: config key {key!r} does not exist"
        )
        if key in missing:
            OmegaConf.update(cfg, key, "placeholder")
    if not doc.complete:  # a partial command: fill in what it leaves out
        for key in missing:
            OmegaConf.update(cfg, key, "placeholder")
    load(cfg, schema)


def _missing_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys whose value is `???` in a container built without resolving."""
    if not isinstance(node, dict):
        return []
    out = []
    for k, v in node.items():
        if k == "hydra" and not prefix:
            continue
        if v == "???":
            out.append(f"{prefix}{k}")
        else:
            out += _missing_keys(v, f"{prefix}{k}.")
    return out


DOCUMENTED = documented()


def test_the_docs_have_commands_to_check():
    # the extraction itself: a parser that found nothing would pass every check below
    assert len(DOCUMENTED) >= 150
    assert {d.argv[0] for d in DOCUMENTED} == set(SCHEMAS)
    assert sum(d.complete for d in DOCUMENTED) >= 60
    assert any(d.error for d in DOCUMENTED)
    assert any(d.where.startswith("Makefile") for d in DOCUMENTED)
    assert any(d.where.startswith("conf/") for d in DOCUMENTED)


@pytest.mark.parametrize("doc", DOCUMENTED, ids=lambda d: f"{d.where}:{d.argv[0]}")
def test_documented_command_is_accepted(doc):
    for overrides in _variants(doc.argv):
        if doc.error is None:
            try:
                _check(doc, overrides)
            except Exception as e:
                pytest.fail(f"{doc.where}: `hydra-heads {' '.join(doc.argv)}` fails: {e}")
        else:
            with pytest.raises(Exception) as info:
                _check(doc, overrides)
            shown = doc.error.rstrip(". ")
            assert shown.split(" ...")[0] in str(info.value), (
                f"{doc.where}: documented error {doc.error!r}, got {info.value}"
            )


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings (not of `#` lines in code blocks): lower case,
    punctuation dropped, spaces to -, a repeated one numbered -1, -2, ..."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for h in re.findall(r"^#+\s+(.*?)\s*$", text, re.M):
        a = re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        out.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return out


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_in_the_docs_exist(page):
    text, bad = page.read_text(), []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", link):  # http(s), mailto
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"link {link}: no {path}")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            bad.append(f"link {link}: no heading with anchor #{anchor} in {path or page.name}")
    # a repository path in backticks (`train/decoding/decoder.py`); OUT/, DIR/: placeholders
    for path in re.findall(r"`([a-z_]+/[\w./-]+\.(?:py|yaml|md|sh|json|toml))`", text):
        if not (ROOT / path).exists() and not (page.parent / path).exists():
            bad.append(f"path {path} does not exist")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)
