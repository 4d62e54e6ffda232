"""prep regenerate=true regen.backend=openai against a real HTTP server in a subprocess
(tests/openai_server.py, aiohttp, serving SmolLM2): concurrent requests, retries of malformed
and failed replies, empty replies counted and skipped, a server that dies mid-run, and a killed
run that resumes by shard to the same bytes as an uninterrupted one."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import REPO, conv, run_here

pytestmark = pytest.mark.slow

QUESTIONS = [f"hello {i}: name a colour" for i in range(8)]


@contextmanager
def server(tmp_path: Path, *flags: str):
    """The test server on a free port; yields (its /v1 URL, a function returning its stats)."""
    import httpx

    portfile = tmp_path / f"port-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.openai_server", "--portfile", str(portfile),
         "--base", "smollm2_135m", *flags],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while not portfile.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert portfile.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() else "slow"
        root = f"http://127.0.0.1:{portfile.read_text()}"
        yield f"{root}/v1", lambda: httpx.get(f"{root}/stats").json()
    finally:
        proc.kill()
        proc.wait()


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "chats.jsonl"
    rows = [conv(("human", q), ("gpt", "ORIGINAL"), cid=f"q{i}") for i, q in enumerate(QUESTIONS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(data: Path, url: str, out: Path, *extra: str) -> list[str]:
    return [
        "data=jsonl", f"data.path={data}", "data.val_fraction=0", f"out={out}",
        "regenerate=true", "regen.backend=openai", f"regen.url={url}", "regen.model=smollm2",
        "regen.max_new_tokens=8", "regen.shard_size=2", "regen.concurrency=4",
        "regen.backoff_s=0", *extra,
    ]  # fmt: skip


def _digest(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in ("prep_timing.json", "config.yaml", "prep_stats.json")
    }


def _tokenizer():
    from train.core.base import BaseConfig, load_tokenizer
    from train.core.config import from_group

    return load_tokenizer(from_group(BaseConfig, "base", "smollm2_135m"))


def _replies(out: Path) -> dict[str, str]:
    import datasets

    tok = _tokenizer()
    ds = datasets.load_from_disk(str(out))["train"]
    return {
        r["conv_id"]: tok.decode(
            [t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m]
        )
        for r in ds
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(the chats, their uninterrupted regeneration through a healthy server): once."""
    root = tmp_path_factory.mktemp("openai_ref")
    data = _data(root)
    with server(root, "--delay", "0.3") as (url, stats):
        r = run_here("prep", *_args(data, url, root / "ref"))
        assert r.returncode == 0, r.stderr[-3000:]
        assert stats()["max_in_flight"] >= 2  # regen.concurrency=4 requests overlapped
    return data, root / "ref"


def test_openai_regen_is_concurrent_and_resumes_after_a_kill_to_the_same_bytes(tmp_path, reference):
    data, ref = reference
    replies = _replies(ref)
    assert len(replies) == 8 and not any("ORIGINAL" in t for t in replies.values())
    assert all(t.endswith("<|im_end|>") and len(t) > len("<|im_end|>") for t in replies.values())
    st = json.loads((ref / "prep_stats.json").read_text())
    assert st["regen_token_ids"] == {"generated": 0, "text": {"none": 8}}  # a server: text only
    # the server's replies counted as their text tokenizes (<|im_end|> is the template's)
    tok = _tokenizer()
    assert st["regeneration"]["turns"] == 8 and st["regeneration"]["reply_tokens"] == sum(
        len(tok(t.removesuffix("<|im_end|>"), add_special_tokens=False)["input_ids"])
        for t in replies.values()
    )
    with server(tmp_path) as (url, _):
        out = tmp_path / "resumed"
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch", "prep", *_args(data, url, out, "regen.concurrency=1")],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        shards = out.parent / f"{out.name}.partial" / "regen"
        deadline = time.time() + 300
        while time.time() < deadline and not (shards / "shard-00001.jsonl").exists():
            assert proc.poll() is None, "prep ended before it could be killed"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert not (shards / "shard-00003.jsonl").exists() and not out.exists()
        r = run_here("prep", *_args(data, url, out))
        assert r.returncode == 0, r.stderr[-3000:]
    assert _digest(out) == _digest(ref)


def test_flaky_replies_are_retried_and_empty_ones_counted_not_written(tmp_path, reference):
    data, ref_out = reference
    ref = _replies(ref_out)
    flags = ("--malformed-every", "3", "--fail-every", "5", "--empty-if", "hello 5")
    # one request at a time, so which request numbers each chat gets is fixed: with 4 in
    # flight, a chat's 4 tries could all land on the server's failing numbers (it happened once)
    extra = ("regen.retries=3", "regen.concurrency=1")
    with server(tmp_path, *flags) as (url, stats):
        r = run_here("prep", *_args(data, url, tmp_path / "flaky", *extra))
        assert r.returncode == 0, r.stderr[-3000:]
        assert stats()["requests"] > 8 + 3  # the malformed and failed ones were asked again
    got = _replies(tmp_path / "flaky")
    assert got == {k: v for k, v in ref.items() if k != "q5"}  # hello 5 dropped, others equal
    st = json.loads((tmp_path / "flaky" / "prep_stats.json").read_text())
    assert st["skipped"] == {"regen_empty_reply": 1}


def test_a_server_that_dies_stops_the_run_and_a_rerun_finishes_it(tmp_path, reference):
    data, ref = reference
    out = tmp_path / "out"
    with server(tmp_path, "--die-after", "5") as (url, _):
        r = run_here("prep", *_args(data, url, out, "regen.concurrency=1", "regen.retries=1"))
    assert r.returncode == 2 and "stopped answering" in r.stderr and "re-run" in r.stderr
    shards = sorted(p.name for p in (tmp_path / "out.partial" / "regen").glob("shard-*"))
    assert shards == ["shard-00000.jsonl", "shard-00001.jsonl"] and not out.exists()
    with server(tmp_path) as (url, stats):  # another port: the finished shards still count
        r = run_here("prep", *_args(data, url, out))
        assert r.returncode == 0, r.stderr[-3000:]
        assert stats()["requests"] == 4  # only the two unfinished shards
    assert _digest(out) == _digest(ref)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["regen.url=null"], "regen.backend=openai needs the server's API root"),
        (["regen.url=localhost:8000"], "an http:// or https:// URL"),
        (["regen.api_key_env=HYDRA_TEST_NO_SUCH_KEY"], "HYDRA_TEST_NO_SUCH_KEY=..."),
    ],
)
def test_bad_endpoint_settings_fail_clearly(tmp_path, extra, message):
    args = _args(_data(tmp_path), "http://127.0.0.1:9/v1", tmp_path / "o", *extra)
    r = run_here("prep", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
