"""Shared fixtures: offline hubs, the tiny model, fixture data (plain helpers: tests/helpers.py)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`make test` runs two workers) each worker gets its share of the cores, and
# the CLI processes that tests start inherit it: torch threads beyond the cores spin against
# each other (two 2-thread processes on 2 cores ran a training step ~2.4x slower).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _share = max(1, (_cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.helpers import GOOD, conv, pattern_rows, prep_config  # noqa: E402


@pytest.fixture
def defects_jsonl(tmp_path: Path) -> Path:
    """A JSONL file with good rows and exactly one row of each defect (see EXPECTED_SKIPS)."""
    lines: list[bytes] = [json.dumps(r).encode() for r in GOOD]
    lines += [
        json.dumps(conv(cid="empty")).encode(),  # empty
        json.dumps(
            {
                "id": "ns",
                "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}],
            }
        ).encode(),
        json.dumps(conv(("human", "hi"), ("wizard", "boo"), cid="role")).encode(),
        json.dumps(conv(("human", "only a question"), cid="noreply")).encode(),
        b'{"id": "broken", "conversations": [',  # invalid JSON
        '{"id": "latin1", "conversations": [{"from": "human", "value": "caf\xe9"}]}'.encode(
            "latin-1"
        ),  # not UTF-8
        json.dumps(GOOD[0]).encode(),  # duplicate of good-1
        json.dumps(conv(("human", "a"), ("human", "b"), ("gpt", "c"), cid="alt")).encode(),
        json.dumps([1, 2]).encode(),  # not an object
        json.dumps({"id": "nofield", "text": "hello"}).encode(),
    ]
    path = tmp_path / "defects.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from train.core.base import tiny_tokenizer as make

    return make()


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's real tokenizer (from the cached conversion of the bundled GGUF)."""
    from train.core.base import load_tokenizer

    return load_tokenizer(prep_config(["out=unused"]).base)


@pytest.fixture(scope="session")
def tiny_prepared(tmp_path_factory) -> Path:
    """A small prepared dataset for the tiny tokenizer, with cached hidden states."""
    from data_prep.prepare import prepare

    root = tmp_path_factory.mktemp("prepared")
    data = root / "pattern.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in pattern_rows()))
    cfg = prep_config(
        [
            "base=tiny_random",
            "data=jsonl",
            f"data.path={data}",
            f"out={root / 'out'}",
            "data.val_fraction=0.15",
            "cache_hidden=true",
        ]
    )
    prepare(cfg)
    return root / "out"


@pytest.fixture(scope="session")
def smol_prepared(tmp_path_factory) -> Path:
    """Bundled ShareGPT prepared for SmolLM2 by the real `hydra-heads prep` (60 conversations,
    512 tokens, 20% held out), once per session: the smoke tests and the SmolLM2 memory plan
    test read it; none of them writes into it."""
    from tests.helpers import run

    out = tmp_path_factory.mktemp("smol") / "data"
    r = run(
        "prep",
        "data.max_conversations=60",
        "data.max_length=512",
        "data.val_fraction=0.2",
        f"out={out}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def tiny_base():
    """The tiny random Llama of conf/base/tiny_random.yaml, frozen, with its tokenizer."""
    from train.core.base import load_base

    return load_base(prep_config(["base=tiny_random", "out=unused"]).base)


def pytest_collection_modifyitems(config, items) -> None:
    """`gpu` tests need CUDA: without it they are skipped (with the reason), never failed, so
    `pytest -m gpu` on a CPU machine reports what it could not check."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason=f"gpu test: torch {torch.__version__} sees no CUDA device "
        f"(built with CUDA {torch.version.cuda}); run `pytest -m gpu` on a GPU machine"
    )
    for item in gpu:
        item.add_marker(skip)
