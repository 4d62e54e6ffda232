"""cache_hidden=true: the base's own final hidden states, saved chunk by chunk (a killed prep
resumes from its chunks), shared out over a launcher's processes with the dataset one process
writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import CLI, pattern_rows, prep_config


def _load(path: Path):
    from datasets import load_from_disk

    return load_from_disk(str(path))


def test_cached_states_are_the_bases_own(tiny_prepared, tiny_base):
    ds = _load(tiny_prepared)["train"]
    for i in (0, 7, len(ds) - 1):
        ids = torch.tensor([ds[i]["input_ids"]])
        with torch.no_grad():
            want = tiny_base.model.model(input_ids=ids).last_hidden_state[0]
        got = torch.tensor(np.asarray(ds[i]["hidden"], dtype=np.float32))
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)  # fp16 storage


def _dd(tiny_prepared):
    from datasets import DatasetDict

    dd = _load(tiny_prepared)
    return DatasetDict({s: dd[s].remove_columns("hidden") for s in dd})


def test_a_killed_cache_resumes_from_its_saved_chunks(tiny_prepared, tmp_path, monkeypatch):
    from data_prep import hidden

    cfg = prep_config(["base=tiny_random", "out=unused"])
    dd = _dd(tiny_prepared)
    work = hidden.chunk_dir(tmp_path, dd, cfg.base, 1)
    first = hidden.cache_hidden_states(dd, cfg.base, 1, "cpu", work)
    chunks = sorted((work / "train").iterdir())
    assert len(chunks) >= 2
    for c in chunks[1:]:  # as if killed after its first train chunk
        subprocess.run(["rm", "-r", str(c)], check=True)
    calls = []
    real = hidden._forward
    monkeypatch.setattr(hidden, "_forward", lambda *a: calls.append(1) or real(*a))
    again = hidden.cache_hidden_states(dd, cfg.base, 1, "cpu", work)
    per_chunk = hidden.chunk_batches(len(dd["train"]), 1)
    assert len(calls) == len(dd["train"]) - per_chunk  # all but the first chunk's batches
    for split in dd:
        assert again[split]["hidden"] == first[split]["hidden"]
        assert again[split]["input_ids"] == dd[split]["input_ids"]
    # another batch size or chunk layout is another chunk dir
    assert hidden.chunk_dir(tmp_path, dd, cfg.base, 2) != work
    monkeypatch.setattr(hidden, "CHUNK_LAYOUT", hidden.CHUNK_LAYOUT + 1)
    assert hidden.chunk_dir(tmp_path, dd, cfg.base, 1) != work


def test_two_ranks_cache_each_chunk_once(tiny_prepared, tmp_path, monkeypatch):
    """In one process, rank 1 of 2 then rank 0 of 2: their shares do not overlap, and rank 0
    finds every chunk there when it has cached its own (it would wait forever for a lost one)."""
    from data_prep import hidden

    cfg = prep_config(["base=tiny_random", "out=unused"])
    dd = _dd(tiny_prepared)
    work = hidden.chunk_dir(tmp_path, dd, cfg.base, 1)
    calls = []
    real = hidden._forward
    monkeypatch.setattr(hidden, "_forward", lambda *a: calls.append(1) or real(*a))

    def waited(work, plan):  # instead of the wait: a chunk no rank cached fails here at once
        missing = [
            (s, c) for s in plan for c in range(len(plan[s]))
            if not (work / s / f"chunk-{c:05d}").is_dir()
        ]  # fmt: skip
        assert not missing, f"no rank cached {missing}"

    monkeypatch.setattr(hidden, "_wait_for_chunks", waited)
    assert hidden.cache_hidden_states(dd, cfg.base, 1, "cpu", work, hidden.Ranks(1, 2)) is None
    by_one = len(calls)
    both = hidden.cache_hidden_states(dd, cfg.base, 1, "cpu", work, hidden.Ranks(0, 2))
    samples = sum(len(dd[s]) for s in dd)
    assert len(calls) == samples  # batch size 1: one forward per sample, none twice
    assert 0 < by_one < samples
    alone = hidden.cache_hidden_states(dd, cfg.base, 1, "cpu", tmp_path / "alone")
    for split in dd:
        assert both[split]["hidden"] == alone[split]["hidden"]


def test_samples_regeneration_covers_take_its_states_and_cost_nothing(
    tiny_prepared, tmp_path, monkeypatch
):
    """Regeneration's states (here: a known array for every other train sample, one of them
    only its start) are taken as they are; the base runs over the other samples only, and
    the shares count only those. With aux layers (which regeneration does not keep) it runs
    over all."""
    from data_prep import hidden

    cfg = prep_config(["base=tiny_random", "out=unused"])
    dd = _dd(tiny_prepared)
    train = dd["train"]
    rng = np.random.default_rng(0)
    covered = list(range(0, len(train), 2))
    kept = []
    for i in covered:
        ids = np.asarray(train[i]["input_ids"], dtype=np.int32)
        if i == 0:  # the sample is the start of a longer regenerated conversation
            ids = np.concatenate([ids, np.asarray([3, 4, 5], dtype=np.int32)])
        kept.append((str(i), ids, rng.standard_normal((len(ids), 64)).astype(np.float16)))
    hidden.save_regen_states(tmp_path / "regen" / "states-00000", kept)
    regen = hidden.RegenStates(tmp_path / "regen")
    calls = []
    real = hidden._forward
    monkeypatch.setattr(
        hidden, "_forward", lambda b, ids, *a: calls.extend(ids) or real(b, ids, *a)
    )
    costs = []
    real_shares = hidden.shares
    monkeypatch.setattr(hidden, "shares", lambda c, w: costs.extend(c) or real_shares(c, w))
    work = hidden.chunk_dir(tmp_path, dd, cfg.base, 1)
    got = hidden.cache_hidden_states(dd, cfg.base, 1, "cpu", work, regen=regen)
    assert len(calls) == sum(len(dd[s]) for s in dd) - len(covered)
    assert regen.taken_samples == len(covered)  # what prep_stats.json records
    want_cost = sum(len(dd[s]) and sum(dd[s]["length"]) for s in dd)
    assert sum(costs) == want_cost - sum(train[i]["length"] for i in covered)
    one = list(costs)
    for (_, _, h), i in zip(kept, covered, strict=True):
        n = len(train[i]["input_ids"])
        np.testing.assert_array_equal(np.asarray(got["train"][i]["hidden"], np.float16), h[:n])
    alone = hidden.cache_hidden_states(dd, cfg.base, 1, "cpu", tmp_path / "alone")
    for i in range(1, len(train), 2):  # the others: the base's own
        assert got["train"][i]["hidden"] == alone["train"][i]["hidden"]
    costs.clear()  # another rank computes the same costs, so the same shares
    hidden.cache_hidden_states(
        dd, cfg.base, 1, "cpu", tmp_path / "r1", hidden.Ranks(1, 2), None, regen
    )
    assert costs == one
    calls.clear()
    aux = hidden.chunk_dir(tmp_path, dd, cfg.base, 1, (1,))
    hidden.cache_hidden_states(dd, cfg.base, 1, "cpu", aux, aux_layers=(1,), regen=regen)
    assert len(calls) == sum(len(dd[s]) for s in dd)
    calls.clear()  # states a bf16 base computed are not a float32 base's
    hidden.save_regen_states(tmp_path / "bf16" / "states-00000", kept, dtype="bfloat16")
    bf16 = hidden.RegenStates(tmp_path / "bf16")
    hidden.cache_hidden_states(dd, cfg.base, 1, "cpu", tmp_path / "w16", regen=bf16)
    assert len(calls) == sum(len(dd[s]) for s in dd) and bf16.taken_samples == 0


def test_chunks_are_shared_out_by_their_padded_tokens():
    from data_prep.hidden import padded_tokens, shares

    # batches [2, 3] and [5, 7]: 2 rows x 3 tokens + 2 rows x 7 tokens
    assert padded_tokens(np.array([3, 5, 2, 7]), np.array([2, 0, 1, 3]), 2) == 20
    assert padded_tokens(np.array([3, 5, 2, 7]), np.array([2, 0, 1]), 2) == 2 * 3 + 5
    # length-sorted chunks cost more and more: every second one to a rank (the old way) gives
    # rank 1 20 of 36; costliest first to the least loaded rank gives 18 each
    costs = [1, 2, 3, 4, 5, 6, 7, 8]
    owner = shares(costs, 2)
    assert owner == [0, 1, 1, 0, 0, 1, 1, 0]
    assert [sum(c for c, r in zip(costs, owner, strict=True) if r == k) for k in (0, 1)] == [18, 18]
    assert shares(costs, 1) == [0] * 8
    assert sorted(set(shares(costs, 3))) == [0, 1, 2]
    # random length-sorted costs: the busiest rank carries less than every N-th chunk gave it
    rng = np.random.default_rng(0)
    costs = sorted(int(x) for x in rng.integers(1, 1000, 37))
    for world in (2, 3, 4):
        owner = shares(costs, world)
        loads = [sum(c for c, r in zip(costs, owner, strict=True) if r == k) for k in range(world)]
        every_nth = [sum(costs[k::world]) for k in range(world)]
        assert max(loads) < max(every_nth), (world, loads, every_nth)
        assert sum(loads) == sum(costs)


@pytest.mark.parametrize(
    ("samples", "batch_size", "want"),
    [(175, 4, 4), (2400, 4, 4), (8000, 4, 8), (100_000, 4, 16), (100_000, 64, 7), (1, 4, 4)],
)
def test_chunks_are_small_for_a_small_split_and_few_for_a_large_one(samples, batch_size, want):
    from data_prep.hidden import chunk_batches

    assert chunk_batches(samples, batch_size) == want


@pytest.mark.parametrize(
    ("device", "rank", "gpus_seen", "want"),
    [
        ("cuda", (3, 16, 3), 8, "cuda:3"),  # torchrun / srun --gpus-per-node: all the node's
        ("cuda", (3, 16, 3), 1, "cuda"),  # srun --gpus-per-task=1: the one bound to the task
        ("cuda", (0, 1, 0), 8, "cuda"),  # one process
        ("cuda:2", (3, 16, 3), 8, "cuda:2"),  # named by the user
        ("cpu", (1, 2, 1), 0, "cpu"),
    ],
)
def test_each_rank_caches_on_a_gpu_it_sees(monkeypatch, device, rank, gpus_seen, want):
    from data_prep.hidden import Ranks, rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus_seen)
    assert rank_device(device, Ranks(*rank)) == want


def test_several_processes_need_cache_hidden(tmp_path, monkeypatch):
    from data_prep.prepare import PrepError, prepare

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in pattern_rows(4)))
    cfg = prep_config(["base=tiny_random", "data=jsonl", f"data.path={data}", f"out={tmp_path}/o"])
    with pytest.raises(PrepError, match="share out cache_hidden=true only"):
        prepare(cfg)


@pytest.mark.slow
def test_two_processes_cache_the_dataset_one_process_does(tmp_path):
    """torchrun --nproc_per_node=2: each rank caches its chunks, rank 0 writes the output,
    equal column for column (hidden states bit for bit) to a one-process prep."""
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in pattern_rows()))
    args = ["prep", "base=tiny_random", "data=jsonl", f"data.path={data}", "cache_hidden=true",
            "cache_batch_size=1", "data.val_fraction=0.15"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [CLI, *args, f"out={tmp_path / 'one'}"], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "--no-python", CLI]  # fmt: skip
    two = subprocess.run(
        [*torchrun, *args, f"out={tmp_path / 'two'}"], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    assert "rank 1/2: its hidden-state chunks are cached" in two.stdout
    a, b = _load(tmp_path / "one"), _load(tmp_path / "two")
    for split in a:
        assert a[split].column_names == b[split].column_names
        for col in a[split].column_names:
            assert a[split][col] == b[split][col], (split, col)
    timing = json.loads((tmp_path / "two" / "prep_timing.json").read_text())
    assert timing["cache_processes"] == 2
    assert not (tmp_path / "two.partial").exists()  # the chunks and samples are cleaned up


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, (0, 1, 0)),
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, (3, 4, 1)),  # torchrun
        ({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "2"}, (2, 8, 2)),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, (0, 1, 0)),  # an sbatch script, not srun
    ],
)
def test_ranks_from_the_launchers_environment(monkeypatch, env, want):
    from data_prep.hidden import Ranks

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"):  # fmt: skip
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = Ranks.from_env()
    assert (r.rank, r.world, r.local) == want
