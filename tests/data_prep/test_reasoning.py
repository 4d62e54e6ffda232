"""Reasoning and tool-call conversations: normalisation, bad rows, byte-exact loss masks."""

from __future__ import annotations

import copy
import json

import datasets
import pytest

from data_prep.normalize import RowError, normalize
from data_prep.template import Encoded, TemplateError, encode_batch, mask_method
from tests.helpers import prep_config
from train.core.base import tiny_tokenizer


def qwen_style(generation: bool, history_drops_reasoning: bool = False) -> str:
    """A Qwen3-style ChatML template: reasoning as a <think> block, tool calls as <tool_call>
    JSON lines, consecutive tool results merged into one user turn of <tool_response>s.
    generation: mark assistant output with {% generation %}. history_drops_reasoning: as Qwen3,
    render reasoning only for turns after the last user turn (it rewrites history)."""
    gen, end = ("{% generation %}", "{% endgeneration %}") if generation else ("", "")
    show = (
        "m.reasoning_content and loop.index0 > ns.last"
        if history_drops_reasoning
        else ("m.reasoning_content")
    )
    return (
        "{%- set ns = namespace(last=-1) -%}"
        "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}"
        "{%- endif -%}{%- endfor -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n' -}}" + gen + "{%- if " + show + " -%}"
        "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}{%- endif -%}"
        "{{- m.content -}}"
        "{%- for c in m.tool_calls or [] -%}"
        "{%- if not loop.first or m.content -%}{{- '\\n' -}}{%- endif -%}"
        "{{- '<tool_call>\\n' + (c.function | tojson) + '\\n</tool_call>' -}}"
        "{%- endfor -%}"
        "{{- '<|im_end|>' -}}" + end + "{{- '\\n' -}}"
        "{%- elif m.role == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
        "{{- '<|im_start|>user' -}}{%- endif -%}"
        "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
        "{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- else -%}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


# An OpenAI-style agent trace: two parallel calls (arguments as a JSON string and as an
# object), their results, an answer whose reasoning is a <think> block, then a plain turn.
AGENT = {
    "messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two cities: call twice.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "24C"},
        {"role": "assistant", "content": "<think>\nCompare.\n</think>\n\nParis 18C, Rome 24C."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You're welcome!"},
    ]
}
CALLS = (
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)
# What carries loss, run by run of masked tokens, decoded.
EXPECTED = {
    "train": [
        "<think>\nTwo cities: call twice.\n</think>\n\n" + CALLS + "<|im_end|>",
        "<think>\nCompare.\n</think>\n\nParis 18C, Rome 24C.<|im_end|>",
        "You're welcome!<|im_end|>",
    ],
    "mask": [CALLS + "<|im_end|>", "Paris 18C, Rome 24C.<|im_end|>", "You're welcome!<|im_end|>"],
}
EXPECTED["drop"] = EXPECTED["mask"]


def masked_text(tok, enc: Encoded) -> list[str]:
    """The decoded runs of consecutive loss tokens."""
    runs: list[list[int]] = [[]]
    for t, m in zip(enc.input_ids, enc.loss_mask, strict=True):
        if m:
            runs[-1].append(t)
        elif runs[-1]:
            runs.append([])
    return [tok.decode(r, skip_special_tokens=False) for r in runs if r]


def with_template(tok, template: str):
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok


def encode_one(tok, msgs, **kw) -> Encoded:
    (enc,) = encode_batch(tok, [msgs], ("assistant",), **kw)
    assert not isinstance(enc, TemplateError), enc
    return enc


# -- normalisation -------------------------------------------------------------------------------
def test_tool_calls_results_and_reasoning_are_normalised():
    msgs = normalize(AGENT)
    assert [m["role"] for m in msgs] == [
        "system", "user", "assistant", "tool", "tool", "assistant", "user", "assistant"
    ]  # fmt: skip
    call = msgs[2]
    assert call["content"] == "" and call["reasoning_content"] == "Two cities: call twice."
    assert call["tool_calls"][0] == {
        "type": "function",
        "function": {"name": "weather", "arguments": {"city": "Paris"}},  # the string parsed
        "id": "c1",
    }
    assert msgs[3] == {"role": "tool", "content": "18C", "tool_call_id": "c1"}
    # the <think> block leaves the reply and becomes the turn's reasoning
    assert msgs[5] == {
        "role": "assistant",
        "content": "Paris 18C, Rome 24C.",
        "reasoning_content": "Compare.",
    }
    assert msgs[-1] == {"role": "assistant", "content": "You're welcome!"}


def test_plain_chats_are_unchanged():
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    msgs = normalize(rec)
    assert msgs == rec["messages"]  # no extra keys: conversation keys (dedup, split) unchanged
    # "tool_calls": [] / null and an empty <think> block add nothing
    rec["messages"][1] |= {"tool_calls": [], "reasoning_content": None}
    assert normalize(rec) == msgs
    rec["messages"][1]["content"] = "<think>\n\n</think>\n\nyo"
    assert normalize(rec) == msgs


def _agent(*changes) -> dict:
    rec = copy.deepcopy(AGENT)
    for change in changes:
        change(rec["messages"])
    return rec


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        # a tool result right after the user turn / after a reply that called nothing
        (lambda m: m.insert(2, {"role": "tool", "content": "x"}), "tool_result_without_call"),
        (lambda m: m.insert(-1, {"role": "tool", "content": "x"}), "tool_result_without_call"),
        (lambda m: m[3].update(tool_call_id="c9"), "tool_result_unknown_call"),
        (lambda m: m.__delitem__(slice(3, 6)), "tool_call_without_result"),
        (lambda m: m[2]["tool_calls"][1]["function"].pop("name"), "bad_tool_call"),
        (lambda m: m[2]["tool_calls"][0]["function"].update(arguments="{x"), "bad_tool_call"),
        (lambda m: m[2].update(tool_calls={"name": "weather"}), "bad_tool_call"),
        (lambda m: m[5].update(content="<think>never closed"), "unclosed_think"),
        (lambda m: m[5].update(reasoning_content="again"), "reasoning_twice"),
        (lambda m: m[5].update(reasoning_content=["a"]), "non_string_content"),
        (lambda m: m[3].update(content=None), "non_string_content"),
        (lambda m: m[2].update(content="", tool_calls=None), "empty_turn"),  # no call
        (lambda m: m.insert(5, {"role": "assistant", "content": "x"}), "non_alternating"),
    ],
)
def test_bad_tool_and_reasoning_rows_are_rejected_by_reason(change, reason):
    with pytest.raises(RowError) as e:
        normalize(_agent(change))
    assert e.value.reason == reason


def test_leading_calls_and_trailing_results_are_dropped():
    # a conversation that starts mid-way: the call and its results go with the dropped turn
    rec = {"messages": AGENT["messages"][2:]}
    assert [m["role"] for m in normalize(rec)] == ["user", "assistant"]
    # results nobody answered are dropped like unanswered user turns; the call is kept
    rec = {"messages": AGENT["messages"][1:5]}
    assert [m["role"] for m in normalize(rec)] == ["user", "assistant"]


# -- the mask method -------------------------------------------------------------------------------
def test_mask_method_is_detected_from_the_template(tiny_tokenizer):
    assert mask_method(tiny_tokenizer) == "spans"  # ChatML without {% generation %}
    tok = with_template(tiny_tokenizer, qwen_style(generation=True))
    assert mask_method(tok) == "generation"
    assert mask_method(tok, ("user", "assistant")) == "spans"  # generation marks replies only
    assert mask_method(with_template(tiny_tokenizer, qwen_style(generation=False))) == "spans"


# -- byte-exact masks on the tiny tokenizer --------------------------------------------------------
@pytest.mark.parametrize("reasoning", ["train", "mask", "drop"])
@pytest.mark.parametrize("generation", [True, False])
def test_qwen_style_masks_are_byte_exact(tiny_tokenizer, generation, reasoning):
    tok = with_template(tiny_tokenizer, qwen_style(generation))
    enc = encode_one(tok, normalize(AGENT), reasoning=reasoning)
    assert masked_text(tok, enc) == EXPECTED[reasoning]
    text = tok.decode(enc.input_ids, skip_special_tokens=False)
    assert ("Two cities" in text) == (reasoning != "drop")  # drop: not even context
    assert text.count("<tool_response>") == 2  # tool results are context only


@pytest.mark.parametrize("generation", [True, False])
def test_train_only_last_turn(tiny_tokenizer, generation):
    tok = with_template(tiny_tokenizer, qwen_style(generation))
    msgs = normalize(AGENT)
    enc = encode_one(tok, msgs, last_turn_only=True)
    assert masked_text(tok, enc) == ["You're welcome!<|im_end|>"]
    # ending in an agent exchange: the last turn is every assistant message after the user turn
    enc = encode_one(tok, msgs[:6], last_turn_only=True, reasoning="mask")
    assert masked_text(tok, enc) == EXPECTED["mask"][:2]


def test_generation_mask_equals_transformers_assistant_mask(tiny_tokenizer):
    tok = with_template(tiny_tokenizer, qwen_style(generation=True))
    msgs = normalize(AGENT)
    hf = tok.apply_chat_template(
        msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    enc = encode_one(tok, msgs)
    assert enc.input_ids == hf["input_ids"]
    assert enc.loss_mask == hf["assistant_masks"]
    # split points: where the second user turn starts (after the reply's end-of-turn newline)
    (start,) = enc.turn_starts
    assert tok.decode(enc.input_ids[start:]).startswith("<|im_start|>user\nThanks")


def test_template_that_drops_old_reasoning_is_placed_by_either_method(tiny_tokenizer):
    """Qwen3 renders reasoning only after the last user turn, so the rendering of a prefix is
    not a prefix of the whole. The span method then finds each turn in the full rendering (the
    tool-call turn by the tail of its rendering that history keeps), and agrees with the
    template's generation blocks."""
    msgs = normalize(AGENT)
    spans = with_template(tiny_tokenizer, qwen_style(False, history_drops_reasoning=True))
    (res,) = encode_batch(spans, [msgs], ("assistant",))
    assert masked_text(spans, res) == EXPECTED["mask"]  # the old reasoning is not rendered
    tok = with_template(tiny_tokenizer, qwen_style(True, history_drops_reasoning=True))
    enc = encode_one(tok, msgs)
    assert masked_text(tok, enc) == EXPECTED["mask"]


# -- the real SmolLM2 template (ChatML: reads neither reasoning_content nor tool_calls) ---------
@pytest.mark.parametrize("reasoning", ["train", "mask", "drop"])
def test_smollm2_template_inlines_reasoning_and_calls(smol_tokenizer, reasoning):
    assert mask_method(smol_tokenizer) == "spans"
    msgs = normalize(AGENT)
    enc = encode_one(smol_tokenizer, msgs, reasoning=reasoning)
    assert masked_text(smol_tokenizer, enc) == EXPECTED[reasoning]
    text = smol_tokenizer.decode(enc.input_ids, skip_special_tokens=False)
    assert "<|im_start|>tool\n18C<|im_end|>\n<|im_start|>tool\n24C<|im_end|>\n" in text
    enc = encode_one(smol_tokenizer, msgs, reasoning=reasoning, last_turn_only=True)
    assert masked_text(smol_tokenizer, enc) == ["You're welcome!<|im_end|>"]


# -- prep end to end -------------------------------------------------------------------------------
def _prep(tmp_path, rows, *extra, tokenizer=None, monkeypatch=None):
    from data_prep import prepare as prep

    data = tmp_path / "agent.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    if tokenizer is not None:
        monkeypatch.setattr(prep, "chat_tokenizer", lambda base: tokenizer)
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    cfg = prep_config(
        ["base=tiny_random", "data=jsonl", f"data.path={data}", f"out={out}",
         "data.val_fraction=0.0", *extra]
    )  # fmt: skip
    return prep.prepare(cfg), datasets.load_from_disk(str(out))["train"]


def test_prep_counts_bad_tool_rows_and_records_the_mask_method(tmp_path, monkeypatch):
    good = [
        {"id": f"a{i}", **_agent(lambda m, i=i: m[1].update(content=f"Q{i}"))} for i in range(3)
    ]
    bad = {"id": "orphan", "messages": [AGENT["messages"][1], AGENT["messages"][3]]}
    bad["messages"].append({"role": "assistant", "content": "x"})
    plain = {"id": "plain", "messages": [{"role": "user", "content": "hi"}]}
    plain["messages"].append({"role": "assistant", "content": "hello"})
    stats, train = _prep(tmp_path, [*good, bad, plain])
    assert stats["skipped"] == {"tool_result_without_call": 1}
    assert stats["mask_method"] == "spans" and stats["reasoning"] == "train"
    assert stats["conversations_kept"] == 4
    (row,) = (r for r in train if r["conv_id"] == "plain")
    assert masked_text(tiny_tokenizer(), Encoded(row["input_ids"], row["loss_mask"], [])) == [
        "hello<|im_end|>"
    ]
    masked, _ = _prep(tmp_path, good, "data.reasoning=mask")
    dropped, _ = _prep(tmp_path, good, "data.reasoning=drop")
    last, _ = _prep(tmp_path, good, "data.train_only_last_turn=true")
    n = [s["trainable_tokens_total"] for s in (stats, masked, dropped, last)]
    assert n[0] > n[1] == n[2] > n[3] > 0
    assert masked["tokens_total"] > dropped["tokens_total"]
    # the saved rows hold exactly what encode_batch masks
    tok = tiny_tokenizer()
    (row,) = (r for r in train if r["conv_id"] == "a0")
    enc = Encoded(row["input_ids"], row["loss_mask"], [])
    assert masked_text(tok, enc) == EXPECTED["train"]
    tok = with_template(tok, qwen_style(generation=True))
    gen, train = _prep(
        tmp_path, good, "data.reasoning=mask", tokenizer=tok, monkeypatch=monkeypatch
    )
    assert gen["mask_method"] == "generation"
    row = train[0]
    assert masked_text(tok, Encoded(row["input_ids"], row["loss_mask"], [])) == EXPECTED["mask"]
