"""Shared test setup: offline hubs, tiny models, fixture data, hydra-composed configs."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def compose(config_name: str, overrides: list[str] | None = None):
    """Compose conf/<config_name>.yaml with overrides, exactly like the CLI does."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from launch.app import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides or [])


def prep_config(overrides: list[str]):
    """A validated PrepConfig composed from conf/prep.yaml + overrides."""
    from data_prep.config import PrepConfig
    from launch.app import to_typed

    return to_typed(compose("prep", overrides), PrepConfig)


def conv(*turns: tuple[str, str], cid: str | None = None) -> dict:
    """A ShareGPT record from (from, value) pairs."""
    rec = {"conversations": [{"from": f, "value": v} for f, v in turns]}
    if cid is not None:
        rec["id"] = cid
    return rec


GOOD = [
    conv(("human", "What is 2+2?"), ("gpt", "2+2 is 4."), cid="good-1"),
    conv(
        ("system", "Be brief."),
        ("human", "Name a colour."),
        ("gpt", "Blue."),
        ("human", "Another?"),
        ("gpt", "Green."),
        cid="good-2",
    ),
    {
        "id": "good-3",
        "messages": [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
        ],
    },
    conv(("user", "Ciao"), ("chatgpt", "Ciao! Come va?"), cid="good-4"),
    conv(("human", "Search this"), ("bing", "Here is what I found."), cid="good-5"),
]


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


EXPECTED_SKIPS = {
    "empty": 1,
    "non_string_content": 1,
    "unknown_role": 1,
    "no_assistant_turn": 1,
    "invalid_json": 1,
    "bad_encoding": 1,
    "duplicate": 1,
    "non_alternating": 1,
    "not_an_object": 1,
    "no_conversation": 1,
}


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from train.base import tiny_tokenizer as make

    return make()


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's real tokenizer (from the cached conversion of the bundled GGUF)."""
    from train.base import load_tokenizer

    return load_tokenizer(prep_config(["out=unused"]).base)


def train_config(overrides: list[str]):
    """A validated TrainConfig composed from conf/train.yaml + overrides."""
    from launch.app import to_typed
    from train.recipe import TrainConfig

    return to_typed(compose("train", overrides), TrainConfig)


def pattern_rows(n: int = 60) -> list[dict]:
    """Chats whose replies follow a learnable rule (counting), as ShareGPT records."""
    import random

    rng = random.Random(0)
    rows = []
    for i in range(n):
        a, step = rng.randint(0, 9), rng.choice([1, 2, 3])
        reply = " ".join(str((a + step * j) % 10) for j in range(24))
        rows.append(
            conv(("human", f"count from {a} by {step}, take {i}"), ("gpt", reply), cid=f"p{i}")
        )
    return rows


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
