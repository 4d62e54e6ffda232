"""Self-distillation: assistant turns come from the base model; a killed job resumes by shard."""

from __future__ import annotations

import json
import re
import statistics

import datasets
import numpy as np
import pytest

from data_prep.prepare import prepare
from data_prep.regenerate import regenerate
from tests.helpers import conv, prep_config, regen_config, wide_console
from train.decoding.sampling import eos_ids


def _rows(n):
    rows = []
    for i in range(n):
        rows.append(
            {
                "conv_id": f"c{i}",
                "key": f"k{i}",
                "roles": ["user", "assistant", "user", "assistant"],
                "contents": [f"q{i}", "ORIGINAL", f"again {i}", "ORIGINAL"],
            }
        )
    return rows


# The random tiny_base model's greedy reply is all whitespace (dropped as empty), so sample.
SAMPLE = {"temperature": 1.0}


def test_regenerates_every_assistant_turn_reproducibly(tmp_path, tiny_base):
    cfg = regen_config(max_new_tokens=6, batch_size=3, shard_size=4, **SAMPLE)
    out = regenerate(_rows(5), tiny_base, cfg, tmp_path / "r")
    assert len(out) == 5
    for r in out:
        assert r["roles"] == ["user", "assistant", "user", "assistant"]
        assert "ORIGINAL" not in r["contents"] and all(c.strip() for c in r["contents"])
    assert regenerate(_rows(5), tiny_base, cfg, tmp_path / "again") == out  # seeded per shard
    other = regenerate(_rows(5), tiny_base, cfg, tmp_path / "seed1", seed=1)
    assert other != out


def test_empty_replies_end_the_conversation(tmp_path, tiny_base):
    from train.core.readers import SkipLog

    skips = SkipLog()
    out = regenerate(_rows(2), tiny_base, regen_config(max_new_tokens=4), tmp_path / "g", 0, skips)
    assert out == [] and skips.counts == {"regen_empty_reply": 2}


def test_a_prompt_over_max_prompt_tokens_ends_its_conversation(tmp_path, tiny_base):
    from train.core.readers import SkipLog

    rows = _rows(2)
    rows[0]["contents"][2] = "long " * 40  # its second prompt is over the limit
    rows[1]["contents"][0] = "long " * 40  # its first prompt already is
    skips = SkipLog()
    cfg = regen_config(max_new_tokens=4, max_prompt_tokens=100, **SAMPLE)
    out = regenerate(rows, tiny_base, cfg, tmp_path / "r", 0, skips)
    assert [r["conv_id"] for r in out] == ["c0"]
    assert out[0]["roles"] == ["user", "assistant"] and out[0]["contents"][1] != "ORIGINAL"
    assert skips.counts == {"regen_prompt_too_long": 1}


def test_killed_run_resumes_at_the_first_missing_shard(tmp_path, tiny_base, monkeypatch):
    import data_prep.regenerate as regen_mod

    cfg = regen_config(max_new_tokens=4, batch_size=2, shard_size=2, **SAMPLE)
    full_stats: dict = {}
    full = regenerate(_rows(6), tiny_base, cfg, tmp_path / "a", stats=full_stats)

    calls = []
    real = regen_mod._regen_shard

    def dies_on_second_shard(rows, base, c, progress, *keep):
        calls.append(rows[0]["conv_id"])
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(rows, base, c, progress, *keep)

    monkeypatch.setattr(regen_mod, "_regen_shard", dies_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        regenerate(_rows(6), tiny_base, cfg, tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "b").glob("shard-*")) == ["shard-00000.jsonl"]
    calls.clear()
    monkeypatch.setattr(regen_mod, "_regen_shard", real)
    monkeypatch.setattr(
        regen_mod,
        "_regen_shard",
        lambda rows, base, c, p, *k: calls.append(rows[0]["conv_id"]) or real(rows, base, c, p, *k),
    )
    stats: dict = {}
    resumed = regenerate(_rows(6), tiny_base, cfg, tmp_path / "b", stats=stats)
    assert calls == ["c2", "c4"]  # shard 0 was not redone
    assert resumed == full
    assert stats["shards_resumed"] == 1  # shard 0 read back: its turns and tokens counted
    for key in ("conversations", "turns", "reply_tokens"):
        assert stats[key] == full_stats[key]
    assert stats["generated_tokens"] < full_stats["generated_tokens"]  # this run's only
    assert [x["shard"] for x in stats["shards_run"]] == [1, 2]
    assert [x["shard"] for x in full_stats["shards_run"]] == [0, 1, 2]
    assert stats["shards_run"] == [
        {**x, "generation_s": y["generation_s"], "wall_s": y["wall_s"]}
        for x, y in zip(full_stats["shards_run"][1:], stats["shards_run"], strict=True)
    ]  # the same shards' counts as in the uninterrupted run


def test_regeneration_counts_its_turns_and_reply_tokens(tmp_path, tiny_base, monkeypatch):
    import data_prep.regenerate as regen_mod

    replies, prompt_lengths = [], []
    real_generate = regen_mod.generate

    def spy(base, prompts, *a, **k):
        ids, states = real_generate(base, prompts, *a, **k)
        replies.extend(ids)
        prompt_lengths.extend(map(len, prompts))
        return ids, states

    monkeypatch.setattr(regen_mod, "generate", spy)
    monkeypatch.setattr(regen_mod, "RATE_MIN_TURNS", 1)  # the tiny shards' rates count
    cfg = regen_config(max_new_tokens=5, batch_size=2, shard_size=2, **SAMPLE)
    full_stats: dict = {}
    full = regenerate(_rows(6), tiny_base, cfg, tmp_path / "a", stats=full_stats)
    decode = tiny_base.tokenizer.decode
    kept = [x for x in replies if decode(x, skip_special_tokens=True).strip()]
    assert full_stats["turns"] == len(kept) == sum(r["roles"].count("assistant") for r in full)
    assert full_stats["reply_tokens"] == sum(map(len, kept)) > 0
    assert full_stats["conversations"] == len(full)
    assert (full_stats["shards"], full_stats["shards_resumed"]) == (3, 0)
    assert full_stats["generated_tokens"] >= full_stats["reply_tokens"]
    assert full_stats["tokens_per_s"] > 0
    assert all("reply_tokens" not in r for r in full)  # counted, not a column of the rows
    assert full_stats["prompt_tokens"] == sum(prompt_lengths) > 0
    shards = full_stats["shards_run"]  # per shard, summing to the run's figures
    assert len(shards) == 3
    for key in ("turns", "prompt_tokens", "generated_tokens"):
        assert sum(x[key] for x in shards) == full_stats[key]
    assert all(x["wall_s"] >= x["generation_s"] > 0 for x in shards)
    rates = sorted(60 * x["turns"] / x["wall_s"] for x in shards if x["turns"])
    assert len(rates) >= 2  # a spread to take
    spread = full_stats["shard_turns_per_min"]
    assert spread == {
        "min": round(rates[0], 1),
        "median": round(statistics.median(rates), 1),
        "max": round(rates[-1], 1),
    }


def test_changed_inputs_discard_stale_shards(tmp_path, tiny_base):
    cfg = regen_config(max_new_tokens=3, shard_size=2, **SAMPLE)
    regenerate(_rows(2), tiny_base, cfg, tmp_path / "r")
    stale = tmp_path / "r" / "shard-00000.jsonl"
    stale.write_text(
        json.dumps(
            {"conv_id": "stale", "key": "x", "roles": [], "contents": [], "regenerated_turns": 1}
        )
        + "\n"
    )
    out = regenerate(_rows(3), tiny_base, cfg, tmp_path / "r")
    assert [r["conv_id"] for r in out] == ["c0", "c1", "c2"]


def test_prep_regenerate_end_to_end_tiny(tmp_path, monkeypatch, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(conv(("human", f"hello {i}"), ("gpt", "ORIGINAL"), cid=f"c{i}"))
            for i in range(4)
        )
    )
    cfg = prep_config(
        [
            "base=tiny_random",
            "data=jsonl",
            f"data.path={data}",
            f"out={tmp_path / 'out'}",
            "data.val_fraction=0",
            "regenerate=true",
            "regen.max_new_tokens=5",
            "regen.shard_size=2",
            "regen.temperature=1.0",
        ]
    )
    monkeypatch.setattr("data_prep.regenerate.RATE_MIN_TURNS", 1)  # the tiny shards' rates
    stats = prepare(cfg)
    assert stats["regenerated"] is True
    assert not (tmp_path / "out.partial").exists()  # work dir removed once published
    tok = __import__("train.core.base", fromlist=["tiny_tokenizer"]).tiny_tokenizer()
    rows = datasets.load_from_disk(str(tmp_path / "out"))["train"]
    assert len(rows) > 0
    regen = stats["regeneration"]  # one regenerated turn a kept conversation
    assert regen["conversations"] == regen["turns"] == len(rows) == stats["conversations_kept"]
    assert regen["turns"] <= regen["reply_tokens"] <= 5 * regen["turns"]
    assert regen["wall_s"] >= regen["generation_s"] >= 0  # rounded to 0.1 s: a tiny model
    assert regen["generated_tokens"] >= regen["reply_tokens"]
    assert regen["turns_per_hour"] == round(regen["turns"] * 3600 / stats["timing"]["regenerate_s"])
    saved = json.loads((tmp_path / "out" / "prep_stats.json").read_text())
    assert saved["regeneration"] == regen
    from launch.commands.prep import print_stats

    wide_console(monkeypatch)  # no wrapped rows
    print_stats(stats, str(tmp_path / "out"))  # the CLI's summary
    shown = capsys.readouterr().out
    assert f"{regen['turns']} ({regen['reply_tokens']})" in shown
    assert f"{regen['turns_per_hour']:,} turns an hour" in shown
    assert f"after {regen['prompt_tokens']:,} prompt tokens" in shown
    spread = regen["shard_turns_per_min"]
    assert f"turns a minute per shard ({len(regen['shards_run'])} run)" in shown
    assert f"min {spread['min']:,} / median {spread['median']:,} / max {spread['max']:,}" in shown
    for row in rows:
        assert "ORIGINAL" not in tok.decode(row["input_ids"])


def test_regeneration_that_empties_every_reply_is_a_clear_error(tmp_path):
    from data_prep.prepare import PrepError

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(conv(("human", "hello"), ("gpt", "ORIGINAL"), cid="c0")))
    overrides = [f"data.path={data}", f"out={tmp_path / 'out'}", "regenerate=true"]
    cfg = prep_config(["base=tiny_random", "data=jsonl", *overrides, "regen.max_new_tokens=3"])
    # the random tiny model's greedy reply is all whitespace: every turn is dropped as empty
    with pytest.raises(PrepError, match=r"regeneration left no conversation.*regen_empty_reply"):
        prepare(cfg)
    assert not (tmp_path / "out").exists()


def _smollm2_prep(tmp_path, convs, *overrides):
    """Prep of these conversations (each a tuple of (role, text)) by SmolLM2, regenerated
    greedy with 12 new tokens a turn, all of them training samples."""
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(conv(*c, cid=f"s{i}")) for i, c in enumerate(convs)))
    return prep_config(
        [
            f"data.path={data}",
            "data=jsonl",
            f"out={tmp_path / 'o'}",
            "data.val_fraction=0",
            "regenerate=true",
            "regen.max_new_tokens=12",
            *overrides,
        ]  # fmt: skip
    )


def test_regenerate_a_few_smollm2_conversations(tmp_path):
    """The real base model answers in its own words (greedy, short)."""
    qs = ["What is the capital of France?", "Say hello in Spanish."]
    cfg = _smollm2_prep(tmp_path, [(("human", q), ("gpt", "ORIGINAL")) for q in qs])
    prepare(cfg)
    ds = datasets.load_from_disk(str(tmp_path / "o"))["train"]
    from train.core.base import load_tokenizer

    tok = load_tokenizer(cfg.base)
    texts = [
        tok.decode([t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m])
        for r in ds
    ]
    assert len(texts) == 2
    assert all("ORIGINAL" not in t and t.endswith("<|im_end|>") for t in texts)
    assert "Paris" in texts[0] or "paris" in texts[0].lower(), texts


def test_batches_group_prompts_of_similar_length_within_the_budget():
    from data_prep.regenerate import plan_batches

    lengths = [50, 3000, 40, 60, 900, 45, 2900, 55, 10_000]
    batches = plan_batches(lengths, max_new_tokens=100, batch_size=3, batch_tokens=6400)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert batches[0] == [8]  # alone over the budget, and first: the longest runs first
    assert [1, 6] in batches  # the two long ones together: 2 x (3000 + 100) <= 6400
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * (max(lengths[i] for i in b) + 100) <= 6400
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat, reverse=True)


@pytest.fixture(scope="module")
def lively_base(tiny_base):
    """tiny_base with larger random weights: its greedy replies vary with the context (the
    stock tiny model repeats one token), so padding or position mistakes change them; EOS is
    `<|im_end|>` plus one token that ends some replies early, so rows finish at different
    steps."""
    import copy

    import torch

    from train.core.base import FrozenBase

    model = copy.deepcopy(tiny_base.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3, generator=g)
    model.generation_config.eos_token_id = [tiny_base.tokenizer.eos_token_id, 93]
    return FrozenBase(model, tiny_base.tokenizer, tiny_base.cfg)


@pytest.mark.parametrize(
    ("batch_size", "batch_tokens", "prefill_tokens", "row_step"),
    [(8, 100_000, 2048, 1), (8, 100_000, 64, 2), (2, 400, 2048, 8)],
    ids=["one-batch-rows-leave", "many-prefills-ballast-rows", "several-batches"],
)
def test_batched_greedy_equals_batch_1_generate(
    lively_base, monkeypatch, batch_size, batch_tokens, prefill_tokens, row_step
):
    import torch

    import data_prep.regenerate as regen_mod
    import train.decoding.slab as slab_mod

    monkeypatch.setattr(slab_mod, "PREFILL_TOKENS", prefill_tokens)
    monkeypatch.setattr(slab_mod, "ROW_STEP", row_step)
    model, eos = lively_base.model, eos_ids(lively_base.tokenizer, lively_base.model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 5, 40, 300, 120, 9)]
    new = 16
    ref = []
    for p in prompts:
        out = model.generate(
            input_ids=torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=sorted(eos),
            pad_token_id=lively_base.tokenizer.pad_token_id,
        )
        ids = out[0, len(p) :].tolist()
        ref.append(ids[:-1] if ids[-1] in eos else ids)  # replies leave EOS out
    assert len({len(r) for r in ref}) > 1  # rows do finish at different steps
    cfg = regen_config(
        max_new_tokens=new, temperature=0.0, batch_size=batch_size, batch_tokens=batch_tokens
    )
    batches = []
    got = regen_mod.generate_replies(lively_base, prompts, cfg, lambda *b: batches.append(b))
    assert got == ref
    assert sum(rows for rows, _, _ in batches) == len(prompts)
    assert (len(batches) > 1) == (batch_size == 2)


def test_packed_weights_regenerate_the_same_replies(lively_base):
    """regen.weight_layout=packed (prep's default): the base's linears on oneDNN-packed
    copies give the same greedy replies as torch's own weights."""
    import copy

    import torch

    import data_prep.regenerate as regen_mod
    from train.decoding.backend import PackedLinear, use_weight_layout

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 40, 7, 120)]
    cfg = regen_config(max_new_tokens=16, temperature=0.0, batch_size=4, batch_tokens=100_000)
    want = regen_mod.generate_replies(lively_base, prompts, cfg)
    packed = copy.copy(lively_base)
    packed.model = copy.deepcopy(lively_base.model)
    assert use_weight_layout(packed.model, layout="packed")
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    assert regen_mod.generate_replies(packed, prompts, cfg) == want


def _tool_row():
    from data_prep.normalize import pack_extras

    msgs = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C and sunny"},
        {"role": "assistant", "content": "ORIGINAL"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "ORIGINAL", "reasoning_content": "they are polite"},
    ]  # fmt: skip
    return {
        "conv_id": "t0",
        "key": "kt0",
        "roles": [m["role"] for m in msgs],
        "contents": [m["content"] for m in msgs],
        "extras": pack_extras(msgs),
    }


def test_tool_calls_and_reasoning_stay_in_the_history_regeneration_sees(
    tmp_path, tiny_base, monkeypatch
):
    """A turn that calls a tool is history, not a reply to regenerate: it and its result are
    kept, the model sees them rendered as training renders them, and every text reply after
    them is regenerated, each conditioned on the regenerated replies before it."""
    import data_prep.regenerate as regen
    from data_prep.normalize import unpack_messages

    prompts_seen = []

    def fake(base, prompts, cfg, on_batch=None, tails=None):
        prompts_seen.extend(prompts)
        replies = [tiny_base.tokenizer.encode(f" reply{len(prompts_seen)}") for _ in prompts]
        return replies, [None] * len(prompts)

    monkeypatch.setattr(regen, "generate", fake)
    cfg = regen_config(max_new_tokens=6)
    row = _tool_row()
    assert regen._planned_turns(row, cfg) == 2  # the tool-calling turn is not a target
    (out,) = regenerate([row], tiny_base, cfg, tmp_path / "r")
    msgs = unpack_messages(out["roles"], out["contents"], out["extras"])
    assert msgs[:3] == unpack_messages(row["roles"], row["contents"], row["extras"])[:3]
    assert [m["content"].strip() for m in (msgs[3], msgs[5])] == ["reply1", "reply2"]
    assert "reasoning_content" not in msgs[5]  # the reply is the base's own now
    tok = tiny_base.tokenizer
    first, second = (tok.decode(p) for p in prompts_seen)
    assert "get_weather" in first and "Paris" in first and "18C and sunny" in first
    assert "reply1" in second and "thanks" in second


def test_regenerated_tool_rows_tokenize_with_their_calls(tmp_path, tiny_base):
    """The kept tool call reaches the prepared sample (not just the regeneration prompt)."""
    from data_prep.prepare import tokenize

    (out,) = regenerate([_tool_row()], tiny_base, regen_config(max_new_tokens=6, **SAMPLE),
                        tmp_path / "r")  # fmt: skip
    cfg = prep_config(["out=unused", "base=tiny_random"])
    samples, _ = tokenize([out], tiny_base.tokenizer, cfg)
    text = tiny_base.tokenizer.decode(samples[0]["input_ids"])
    assert "get_weather" in text and "18C and sunny" in text


def test_wire_messages_follow_the_chat_completions_format():
    from data_prep.normalize import unpack_messages
    from data_prep.openai_backend import wire_messages

    row = _tool_row()
    wire = wire_messages(unpack_messages(row["roles"], row["contents"], row["extras"]))
    call = wire[1]["tool_calls"][0]
    assert call["id"] == "call_1_0" and call["type"] == "function"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert wire[2] == {"role": "tool", "content": "18C and sunny", "tool_call_id": "call_1_0"}
    assert all("reasoning_content" not in m for m in wire)


# ---- regen.keep_states: regeneration's hidden states, for caching to take -------------------


@pytest.mark.parametrize(("prefill_tokens", "row_step"), [(2048, 1), (64, 8)])
def test_kept_states_are_a_full_forwards_over_prompt_reply_and_tail(
    lively_base, monkeypatch, prefill_tokens, row_step
):
    """The states a row keeps are the base's own over prompt + reply + tail, as one forward
    over those tokens computes them, whether the row ended on EOS or at max_new_tokens, and
    whether it left the batch early (row_step 1) or stayed as ballast; the replies are those
    generated without states; a row whose tail is None keeps none."""
    import torch

    import train.decoding.slab as slab_mod

    monkeypatch.setattr(slab_mod, "PREFILL_TOKENS", prefill_tokens)
    monkeypatch.setattr(slab_mod, "ROW_STEP", row_step)
    model, eos = lively_base.model, eos_ids(lively_base.tokenizer, lively_base.model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 40, 120, 9, 70)]
    tails = [[258, 10], [258, 10], None, [7], [258, 10]]
    args = (model, prompts, 16, eos, 0, 0.0, 1.0)
    plain = slab_mod.generate_left_padded(*args)
    tokens, states = slab_mod.generate_left_padded(*args, tails)
    assert tokens == plain
    ends = {len(t) == 16 and t[-1] not in eos for t in tokens}
    assert ends == {True, False}  # some rows hit the limit, some ended on EOS
    assert states[2] is None
    for p, t, tail, st in zip(prompts, tokens, tails, states, strict=True):
        if tail is None:
            continue
        reply = t[:-1] if t[-1] in eos else t
        ids = torch.tensor([p + reply + tail])
        with torch.no_grad():
            want = model.model(input_ids=ids).last_hidden_state[0]
        assert st.dtype == np.float16 and st.shape == tuple(want.shape)
        torch.testing.assert_close(torch.from_numpy(st.astype(np.float32)), want, **FP16)


FP16 = {"atol": 2e-3, "rtol": 2e-3}  # one float16 rounding apart


def test_the_reply_tail_is_what_the_template_puts_after_a_reply(tiny_base):
    from data_prep.regenerate import reply_tail, turn_prompt

    tok = tiny_base.tokenizer
    history = [{"role": "user", "content": "hi"}]
    tail = reply_tail(tok, history, turn_prompt(tok, history))
    assert tok.decode(tail) == "<|im_end|>\n"
    # a template that renders the history otherwise once a reply follows gives no tail
    assert reply_tail(tok, history, turn_prompt(tok, history)[:-1] + [5]) is None


def test_regen_states_serve_a_conversation_and_its_start_only(tmp_path):
    from data_prep.hidden import RegenStates, save_regen_states

    rng = np.random.default_rng(0)
    a = rng.integers(0, 500, 80).astype(np.int32)
    b = np.concatenate([a[:60], rng.integers(0, 500, 30)]).astype(np.int32)  # a's start, then not
    short = np.arange(10, dtype=np.int32)
    kept = [(k, x, rng.standard_normal((len(x), 4)).astype(np.float16)) for k, x in
            (("a", a), ("b", b), ("s", short))]  # fmt: skip
    save_regen_states(tmp_path / "states-00000", kept)
    save_regen_states(tmp_path / "states-00001", kept[:1], dtype="bfloat16")
    (tmp_path / "states-00002").mkdir()  # not written whole (no meta.json): ignored
    np.save(tmp_path / "states-00002" / "lengths.npy", np.asarray([80]))
    st = RegenStates(tmp_path, dtype="float32")  # the bf16 base's states are not a float32's
    assert len(st) == 3
    assert len(RegenStates(tmp_path)) == 4 and len(RegenStates(tmp_path, "bfloat16")) == 1
    np.testing.assert_array_equal(st.lookup(a), kept[0][2])
    np.testing.assert_array_equal(st.lookup(b.tolist()), kept[1][2])
    np.testing.assert_array_equal(st.lookup(a[:50]), kept[0][2][:50])  # a sample cut short
    np.testing.assert_array_equal(st.lookup(b[:70]), kept[1][2][:70])
    np.testing.assert_array_equal(st.lookup(short), kept[2][2])
    assert st.lookup(np.concatenate([a, [1]])) is None  # longer than any
    assert st.lookup(np.concatenate([a[:70], [1, 2]])) is None  # diverges from both
    assert st.lookup(short[:5]) is None  # under RegenStates.KEY tokens: whole only
    assert st.lookup(a[1:]) is None  # a later piece: its states differ
    assert RegenStates(tmp_path / "none").lookup(a) is None


def test_a_killed_run_keeps_the_states_of_the_shards_it_wrote(tmp_path, tiny_base, monkeypatch):
    import data_prep.regenerate as regen_mod
    from data_prep.hidden import RegenStates

    cfg = regen_config(max_new_tokens=4, batch_size=2, shard_size=2, **SAMPLE)
    real = regen_mod._regen_shard
    calls = []

    def dies_on_second_shard(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(*a)

    monkeypatch.setattr(regen_mod, "_regen_shard", dies_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        regenerate(_rows(4), tiny_base, cfg, tmp_path / "r", keep_states=True)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [
        "manifest.json", "shard-00000.jsonl", "states-00000"
    ]  # fmt: skip
    monkeypatch.setattr(regen_mod, "_regen_shard", real)
    # killed again, between the second shard's states and the shard itself
    real_write = regen_mod.write_text

    def dies_writing_a_shard(path, text):
        if path.name == "shard-00001.jsonl":
            raise KeyboardInterrupt("killed")
        return real_write(path, text)

    monkeypatch.setattr(regen_mod, "write_text", dies_writing_a_shard)
    with pytest.raises(KeyboardInterrupt):
        regenerate(_rows(4), tiny_base, cfg, tmp_path / "r", keep_states=True)
    assert (tmp_path / "r" / "states-00001").is_dir()
    assert not (tmp_path / "r" / "shard-00001.jsonl").exists()
    monkeypatch.setattr(regen_mod, "write_text", real_write)
    rows = regenerate(_rows(4), tiny_base, cfg, tmp_path / "r", keep_states=True)
    assert rows == regenerate(_rows(4), tiny_base, cfg, tmp_path / "whole", keep_states=True)
    st = RegenStates(tmp_path / "r")
    assert len(st) == len(rows) == 4  # each conversation's last regenerated turn, once
    for a, b in zip(st.parts, RegenStates(tmp_path / "whole").parts, strict=True):
        np.testing.assert_array_equal(a[0], b[0])  # the same tokens as an unbroken run
    H = tiny_base.hidden_size
    assert all(h.shape[1] == H for _, h in st.parts)
    assert not list((tmp_path / "r").glob(".states-*"))  # no staging dir left behind


def test_caching_takes_regenerations_states_in_prep(tmp_path, capsys):
    """SmolLM2 answers two turns of a few conversations; each sample is the tokens its last
    turn ran over (regen.token_ids), so caching takes regeneration's states for every one,
    and every sample's states are the base's own, as caching alone computes them."""
    from data_prep.hidden import cache_hidden_states

    qs = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish.",
          "What is 2 + 2?"]  # fmt: skip
    turns = [(("human", q), ("gpt", "X"), ("human", "Why?"), ("gpt", "Y")) for q in qs]
    cfg = _smollm2_prep(
        tmp_path,
        turns,
        "cache_hidden=true",
        "data.max_length=70",
        "data.long_conversations=truncate",
    )
    stats = prepare(cfg)
    taken = re.search(r"hidden states of (\d+) of (\d+) samples taken", capsys.readouterr().out)
    dd = datasets.load_from_disk(str(tmp_path / "o"))
    assert int(taken[1]) == int(taken[2]) == len(dd["train"]) == 4
    assert stats["cached_from_regeneration"] == 4
    assert stats["regen_token_ids"] == {"generated": 4, "text": {}}
    assert any(n == 70 for n in dd["train"]["length"])  # a sample cut at max_length took them too
    ref = cache_hidden_states(dd.remove_columns("hidden"), cfg.base, 4, "cpu", tmp_path / "w")
    for got, want in zip(dd["train"]["hidden"], ref["train"]["hidden"], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-3)


def test_turning_keep_states_on_or_off_keeps_finished_shards(tmp_path, tiny_base, monkeypatch):
    import data_prep.regenerate as regen_mod

    cfg = regen_config(max_new_tokens=3, shard_size=2, keep_states=False, **SAMPLE)
    first = regenerate(_rows(2), tiny_base, cfg, tmp_path / "r")
    monkeypatch.setattr(regen_mod, "_regen_shard", lambda *a: pytest.fail("shard redone"))
    on = regen_config(max_new_tokens=3, shard_size=2, keep_states=True, **SAMPLE)
    assert regenerate(_rows(2), tiny_base, on, tmp_path / "r", keep_states=True) == first
    assert regenerate(_rows(2), tiny_base, cfg, tmp_path / "r") == first  # and off again


# ---- regen.token_ids: a regenerated sample is the tokens the base ran over -----------------


def test_generated_encoding_lines_the_reply_up_with_the_texts_mask():
    from data_prep.template import Encoded, generated_encoding

    # the text: prompt 1 2 3 | reply 10 11 (its text tokenized) | tail 20 21
    enc = Encoded([1, 2, 3, 10, 11, 20, 21], [0, 0, 1, 1, 1, 1, 0], [2])
    got = generated_encoding(enc, [1, 2, 3, 12, 13, 14, 20, 21], [3, 6])
    assert got.input_ids == [1, 2, 3, 12, 13, 14, 20, 21]
    assert got.loss_mask == [0, 0, 1, 1, 1, 1, 1, 0]  # prompt's and tail's from the text
    assert got.turn_starts == [2]
    assert generated_encoding(enc, [9, 2, 3, 12, 20, 21], [3, 4]) == "prompt"
    assert generated_encoding(enc, [1, 2, 3, 12, 20, 22], [3, 4]) == "tail"
    masked = Encoded(enc.input_ids, [0, 0, 1, 0, 1, 1, 0], [])  # a reply partly masked
    assert generated_encoding(masked, [1, 2, 3, 12, 20, 21], [3, 4]) == "mask"
    no_loss = Encoded(enc.input_ids, [0] * 7, [])  # the reply's role carries no loss
    assert generated_encoding(no_loss, [1, 2, 3, 12, 20, 21], [3, 4]).loss_mask == [0] * 6
    bare = Encoded([1, 2, 3, 10, 11], [0, 0, 0, 1, 1], [])  # a template with no tail
    got = generated_encoding(bare, [1, 2, 3, 12, 13, 14], [3, 6])
    assert got.loss_mask == [0, 0, 0, 1, 1, 1]


def test_token_ids_are_what_the_last_regenerated_turn_ran_over(tmp_path, tiny_base):
    """Its prompt (the earlier replies as their text renders), the reply, the tail; a
    conversation cut short before its second turn records its first."""
    from data_prep.regenerate import reply_tail, turn_prompt

    rows = _rows(2)
    rows[0]["contents"][2] = "long " * 40  # its second prompt is over the limit
    cfg = regen_config(max_new_tokens=5, max_prompt_tokens=100, **SAMPLE)
    out = regenerate(rows, tiny_base, cfg, tmp_path / "r")
    tok = tiny_base.tokenizer
    assert [len(r["roles"]) for r in out] == [2, 4]
    for r in out:
        msgs = [{"role": a, "content": b} for a, b in zip(r["roles"], r["contents"], strict=True)]
        ids, (start, end) = r["token_ids"], r["reply_at"]
        prompt = turn_prompt(tok, msgs[:-1])
        assert ids[:start] == prompt and 0 < end - start <= 5
        assert ids[end:] == reply_tail(tok, msgs[:-1], prompt)
        assert tok.decode(ids[start:end], skip_special_tokens=True).strip() == msgs[-1]["content"]


def _tiny_regen_prep(tmp_path, name, *overrides):
    data = tmp_path / "d.jsonl"
    turns = (("human", "hello"), ("gpt", "ORIGINAL"), ("human", "more"), ("gpt", "ORIGINAL"))
    data.write_text("\n".join(json.dumps(conv(*turns, cid=f"c{i}")) for i in range(6)))
    cfg = prep_config(
        [
            "base=tiny_random",
            "data=jsonl",
            f"data.path={data}",
            f"out={tmp_path / name}",
            "data.val_fraction=0",
            "regenerate=true",
            "regen.max_new_tokens=8",
            "regen.shard_size=4",
            "regen.temperature=1.0",
            *overrides,
        ]
    )
    stats = prepare(cfg)
    return stats, datasets.load_from_disk(str(tmp_path / name))["train"]


def test_regenerated_samples_are_the_tokens_the_base_generated(tmp_path, monkeypatch):
    """The tiny model samples arbitrary tokens, whose decoded text tokenizes otherwise: with
    regen.token_ids the samples are the generated tokens (the replies are the same, the draws
    seeded per shard), without it the text's."""
    import data_prep.regenerate as regen_mod

    recorded = {}
    real = regen_mod._regen_shard

    def spy(rows, *a, **k):
        out, kept = real(rows, *a, **k)
        recorded.update({r["conv_id"]: r for r in out})
        return out, kept

    monkeypatch.setattr(regen_mod, "_regen_shard", spy)
    stats, ids = _tiny_regen_prep(tmp_path, "ids")
    _, text = _tiny_regen_prep(tmp_path, "text", "regen.token_ids=false")
    assert stats["regen_token_ids"] == {"generated": len(ids), "text": {}}
    assert len(ids) == len(text) == len(recorded)
    differ = 0
    for a, b in zip(ids, text, strict=True):
        r = recorded[a["conv_id"]]
        start, end = r["reply_at"]
        assert a["input_ids"] == r["token_ids"]  # prompt + the reply as generated + tail
        assert len(a["loss_mask"]) == len(a["input_ids"]) and all(a["loss_mask"][start:end])
        assert b["input_ids"][:start] == a["input_ids"][:start]  # the same prompt
        assert a["loss_mask"][:start] == b["loss_mask"][:start]  # and mask, and tail's mask
        assert (
            a["loss_mask"][end:]
            == b["loss_mask"][len(b["input_ids"]) - len(a["input_ids"]) + end :]
        )
        differ += a["input_ids"] != b["input_ids"]
    assert differ  # some reply's text tokenizes otherwise than it was generated


def test_a_server_or_older_shard_without_token_ids_keeps_the_texts_tokens(tmp_path, monkeypatch):
    import data_prep.regenerate as regen_mod

    real = regen_mod._regen_shard

    def without_ids(rows, *a, **k):
        out, kept = real(rows, *a, **k)
        for r in out:
            del r["token_ids"], r["reply_at"]  # as a shard written before they were recorded
        return out, kept

    monkeypatch.setattr(regen_mod, "_regen_shard", without_ids)
    stats, ids = _tiny_regen_prep(tmp_path, "old")
    _, text = _tiny_regen_prep(tmp_path, "text", "regen.token_ids=false")
    assert stats["regen_token_ids"] == {"generated": 0, "text": {"none": len(ids)}}
    assert ids["input_ids"] == text["input_ids"]
