"""Loss masks: masked spans decode back to exactly the assistant replies, for several templates."""

from __future__ import annotations

import copy

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from data_prep.template import Encoded, TemplateError, chunk, encode_batch, loss_spans

LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
VICUNA = (
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}{% else %}"
    "{{ 'A chat between a curious user and an artificial intelligence assistant. ' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}"
    "{% elif m['role'] == 'assistant' %}{{ 'ASSISTANT: ' + m['content'] + '</s>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
EOT = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "vicuna": "</s>"}

CONVS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "Blue, obviously.\n\n- and *green*"},
        {"role": "user", "content": "Say hi in Chinese"},
        {"role": "assistant", "content": "你好！ (nǐ hǎo)"},
    ],
    [
        {"role": "user", "content": "code?"},
        {"role": "assistant", "content": "```python\nprint('x')\n```"},
    ],
]


def with_template(tok, name: str):
    tok = copy.deepcopy(tok)
    if name == "llama3":
        tok.add_tokens(
            ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            special_tokens=True,
        )
        tok.chat_template = LLAMA3
    elif name == "vicuna":
        tok.add_tokens(["</s>"], special_tokens=True)
        tok.chat_template = VICUNA
    return tok


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def assert_mask_is_replies(tok, msgs, enc: Encoded, eot: str) -> None:
    replies = [m["content"] for m in msgs if m["role"] == "assistant"]
    runs = masked_runs(enc.input_ids, enc.loss_mask)
    decoded = [tok.decode(r, skip_special_tokens=False) for r in runs]
    assert len(decoded) == len(replies), decoded
    for got, reply in zip(decoded, replies, strict=True):
        # The reply and its end-of-turn token, nothing of the header.
        assert got.lstrip() == reply.strip() + eot


@pytest.mark.parametrize("template", ["chatml", "llama3", "vicuna"])
@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_masked_spans_decode_to_assistant_replies(which, template, request):
    tok = with_template(request.getfixturevalue(f"{which}_tokenizer"), template)
    for msgs, enc in zip(CONVS, encode_batch(tok, CONVS, ("assistant",)), strict=True):
        assert not isinstance(enc, TemplateError)
        assert_mask_is_replies(tok, msgs, enc, EOT[template])


def test_smollm2_template_header_and_system_prompt_are_not_trained(smol_tokenizer):
    msgs = CONVS[0]
    (enc,) = encode_batch(smol_tokenizer, [msgs], ("assistant",))
    text = smol_tokenizer.decode(
        [t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if not m]
    )
    assert "SmolLM" in text  # the template's default system prompt is context only
    assert text.endswith("<|im_start|>assistant\n\n")  # header kept out; newline after eot too
    assert smol_tokenizer.decode(enc.input_ids[-2:]) == "<|im_end|>\n"
    assert enc.loss_mask[-2:] == [1, 0]


text = st.text(alphabet=st.sampled_from(list("ab c\n\t.é你😀<>|_")), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(text, text), min_size=1, max_size=4))
def test_mask_property_chatml(tiny_tokenizer, pairs):
    pairs = [(q, a) for q, a in pairs if q.strip() and a.strip()]
    msgs = [
        m
        for q, a in pairs
        for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})
    ]
    assume(msgs)  # all-whitespace pairs: Hypothesis draws another example
    (enc,) = encode_batch(tiny_tokenizer, [msgs], ("assistant",))
    runs = masked_runs(enc.input_ids, enc.loss_mask)
    joined = "".join(tiny_tokenizer.decode(r) for r in runs)
    assert joined == "".join(a + "<|im_end|>" for _, a in pairs)


def test_loss_on_user_turns_too(tiny_tokenizer):
    (enc,) = encode_batch(tiny_tokenizer, [CONVS[0]], ("user", "assistant"))
    runs = [tiny_tokenizer.decode(r) for r in masked_runs(enc.input_ids, enc.loss_mask)]
    assert runs == ["<|im_start|>user\nWhat is 2+2?<|im_end|>", "It is 4.<|im_end|>"]


def test_template_that_rewrites_history_has_its_turns_found(tiny_tokenizer):
    """A rendering that is not a prefix of its continuation (here: the message count first)
    has each reply found in the full text; one that rewrites the contents is rejected."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    text, spans, _ = loss_spans(tok, CONVS[0])
    assert [text[a:b] for a, b in spans] == ["It is 4."]
    tok.chat_template = (
        "{{ messages | length }}{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    )
    with pytest.raises(TemplateError, match="message 1's content is not in its rendering"):
        loss_spans(tok, CONVS[0])
    (res,) = encode_batch(tok, [CONVS[0]], ("assistant",))
    assert isinstance(res, TemplateError)


# Gemma's templates refuse a system turn through the template's own raise_exception
REFUSES_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_conversation_the_template_refuses_is_one_skipped_row(tiny_tokenizer):
    """The template's raise_exception (a jinja2 error) becomes our TemplateError for that row,
    which prep counts as template_error, while the other rows of the batch encode."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = REFUSES_SYSTEM
    system = [{"role": "system", "content": "Be brief."}, *CONVS[0]]
    bad, good = encode_batch(tok, [system, CONVS[0]], ("assistant",))
    assert isinstance(bad, TemplateError) and "System role not supported" in str(bad)
    assert isinstance(good, Encoded) and sum(good.loss_mask) > 0


def test_prep_keeps_what_the_template_said_of_a_refused_conversation(tiny_tokenizer):
    from data_prep.normalize import pack_extras
    from data_prep.prepare import kept_samples, tokenize
    from tests.helpers import prep_config
    from train.core.readers import SkipLog

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = REFUSES_SYSTEM
    convs = {"sys": [{"role": "system", "content": "Be brief."}, *CONVS[0]], "ok": CONVS[0]}
    rows = [
        {
            "conv_id": cid,
            "key": cid,
            "roles": [m["role"] for m in msgs],
            "contents": [m["content"] for m in msgs],
            "extras": pack_extras(msgs),
        }
        for cid, msgs in convs.items()
    ]
    cfg = prep_config(["out=unused", "base=tiny_random", "data.val_fraction=0.0"])
    samples, _ = tokenize(rows, tok, cfg)
    skips = SkipLog()
    kept, _ = kept_samples(samples, skips)
    assert kept["conv_id"] == ["ok"]
    assert skips.counts == {"template_error": 1}
    assert skips.examples["template_error"] == [
        "conversation sys: the chat template refuses this conversation: System role not supported"
    ]


def test_an_eval_prompt_the_template_refuses_is_a_config_error(tiny_tokenizer):
    from evaluation.evaluate import render_chat
    from train.core.errors import ConfigError

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = REFUSES_SYSTEM
    assert render_chat(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ConfigError, match=r"refuses an eval prompt with the turns \[system, user"):
        render_chat(tok, [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_templates_that_re_render_earlier_turns(family):
    """Qwen3 drops the empty think block of replies before the last user turn, and Phi-3 ends
    a rendering with an end-of-text token: every reply is still found, with its end-of-turn
    token, and the last one as the template renders it after the generation prompt."""
    from tests.families import TEMPLATES, tokenizer

    tok = tokenizer(family)
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
        {"role": "assistant", "content": "Sure"},
    ]
    eot = TEMPLATES[family][3]
    text, spans, starts = loss_spans(tok, msgs)
    last = {"qwen3": f"<think>\n\n</think>\n\nSure{eot}", "phi3": f"Sure{eot}\n{eot}"}
    assert [text[a:b] for a, b in spans] == [f"Hello{eot}", last[family]]
    assert text[starts[0] :].startswith(("<|im_start|>user\nMore", "<|user|>\nMore"))
    (enc,) = encode_batch(tok, [msgs], ("assistant",))
    runs = [tok.decode(r) for r in masked_runs(enc.input_ids, enc.loss_mask)]
    assert runs == [f"Hello{eot}", last[family]]


def test_chunk_split_truncate_drop(tiny_tokenizer):
    msgs = CONVS[1]
    (enc,) = encode_batch(tiny_tokenizer, [msgs], ("assistant",))
    n = len(enc.input_ids)
    assert chunk(enc, n, "split") == [(enc.input_ids, enc.loss_mask)]
    assert chunk(enc, n - 1, "drop") == "too_long"
    ((ids, mask),) = chunk(enc, 40, "truncate")
    assert ids == enc.input_ids[:40] and mask == enc.loss_mask[:40]
    second_user = enc.turn_starts[0]
    pieces = chunk(enc, second_user + 5, "split")
    # The first piece ends exactly where the second user turn starts; pieces tile the sample.
    assert len(pieces[0][0]) == second_user
    assert tiny_tokenizer.decode(pieces[1][0]).startswith("<|im_start|>user\nSay hi")
    assert sum((p[0] for p in pieces), []) == enc.input_ids
    assert sum((p[1] for p in pieces), []) == enc.loss_mask
    assert all(len(p[0]) <= second_user + 5 for p in pieces)


@pytest.mark.parametrize("template", ["chatml", "llama3", "vicuna"])
@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_fast_path_equals_exact_path(which, template, request):
    """The cached-skeleton spans and slice-built masks agree with the per-turn reference."""
    from data_prep.template import mask_from_encoding, mask_from_offsets

    tok = with_template(request.getfixturevalue(f"{which}_tokenizer"), template)
    convs = [
        *CONVS,
        [
            {"role": "user", "content": "  padded  "},
            {"role": "assistant", "content": " lead and trail \n"},
        ],
    ]
    for msgs in convs:
        exact = loss_spans(tok, msgs, ("assistant",))
        fast = fast_spans(tok, msgs, ("assistant",))
        if fast is None:  # only templates that rewrite content may fall back
            assert template == "llama3" and msgs is convs[-1]
            continue
        assert fast == exact
        text, spans, _ = exact
        enc = tok.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0]
        assert mask_from_encoding(text, enc, spans) == mask_from_offsets(text, enc.offsets, spans)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(text, text), min_size=1, max_size=4), st.booleans())
def test_fast_path_property(tiny_tokenizer, pairs, system):
    from data_prep.template import mask_from_encoding, mask_from_offsets

    msgs = [{"role": "system", "content": "sys"}] if system else []
    msgs += [
        m
        for q, a in pairs
        for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})
    ]
    exact = loss_spans(tiny_tokenizer, msgs, ("assistant",))
    assert fast_spans(tiny_tokenizer, msgs, ("assistant",)) == exact
    text, spans, _ = exact
    enc = tiny_tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0]
    assert mask_from_encoding(text, enc, spans) == mask_from_offsets(text, enc.offsets, spans)


def fast_spans(tokenizer, messages, loss_roles):
    """loss_spans()'s shape from the cached-skeleton path; None where it does not apply."""
    from data_prep.template import fast_turn_spans

    r = fast_turn_spans(tokenizer, messages, loss_roles)
    return None if r is None else (r[0], [(a, b) for _, a, b in r[1]], r[2])
