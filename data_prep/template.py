"""Apply the base model's chat template and mark the tokens that carry loss (assistant replies)."""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass

import numpy as np
from jinja2 import TemplateError as JinjaTemplateError

from train.core.errors import UserError


class TemplateError(UserError, ValueError):
    """The chat template cannot be used to locate turns (e.g. it rewrites earlier turns)."""


@dataclass
class Encoded:
    """One tokenized conversation."""

    input_ids: list[int]
    loss_mask: list[int]
    # Token index where each user turn after the first starts: safe places to split.
    turn_starts: list[int]


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template's rendering; TemplateError where the template refuses the conversation
    (its `raise_exception`: Gemma's templates refuse a system turn, several refuse turns that do
    not alternate), so prep skips and counts that row as `template_error`."""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except JinjaTemplateError as e:
        raise TemplateError(f"the chat template refuses this conversation: {e}") from e


def loss_spans(
    tokenizer, messages: list[dict[str, str]], loss_roles: tuple[str, ...] = ("assistant",)
) -> tuple[str, list[tuple[int, int]], list[int]]:
    """Render `messages`; return (text, char spans that carry loss, char starts of user turns).

    The span of message i is what rendering messages[: i + 1] adds to rendering messages[:i]
    followed by the generation prompt: the reply and its end-of-turn token, without the
    assistant header. Trailing whitespace after the end-of-turn token is left out. Templates
    whose renderings of a growing conversation are not prefixes of each other (Qwen3, Phi-3)
    have each turn found in the full rendering instead (_searched_spans).
    """
    text, spans, user_starts = _turn_spans(tokenizer, messages, loss_roles)
    return text, [(a, b) for _, a, b in spans], user_starts


def _turn_spans(
    tokenizer, messages: list[dict], loss_roles: tuple[str, ...]
) -> tuple[str, list[tuple[int, int, int]], list[int]]:
    """loss_spans() with each span's message index: (text, [(i, start, end)], user starts).

    Templates that re-render earlier turns once the conversation goes on (Qwen3 drops the
    `<think>` block of every reply before the last user turn; Phi-3 ends a rendering with an
    end-of-text token that its continuation does not have) take _searched_spans()."""
    text = render(tokenizer, messages)
    try:
        return text, *_prefix_spans(tokenizer, messages, loss_roles, text)
    except TemplateError:
        return text, *_searched_spans(tokenizer, messages, loss_roles, text)


def _prefix_spans(tokenizer, messages, loss_roles, text):
    """Spans as what rendering messages[: i + 1] adds to messages[:i] + the generation prompt;
    TemplateError when a rendering is not a prefix of the next."""
    spans: list[tuple[int, int, int]] = []
    user_starts: list[int] = []
    prev = ""  # rendering of messages[:i]
    for i, m in enumerate(messages):
        full = render(tokenizer, messages[: i + 1]) if i + 1 < len(messages) else text
        if m["role"] == "user" and i > 0 and messages[i - 1]["role"] == "assistant":
            user_starts.append(len(prev))
        if m["role"] in loss_roles:
            head = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
            if m["role"] != "assistant":
                head = prev
            if not full.startswith(head) or not text.startswith(full):
                raise TemplateError(
                    "the chat template does not render a conversation as a prefix of its "
                    "continuation (it rewrites earlier turns), so reply tokens cannot be located"
                )
            end = len(full.rstrip())
            if end > len(head):
                spans.append((i, len(head), end))
        prev = full
    return spans, user_starts


_NON_SPACE = re.compile(r"\S*")


def _searched_spans(tokenizer, messages, loss_roles, text):
    """Spans found in the full rendering, in message order, each before the next message's
    content. A loss turn's span is the longest tail of what the template renders for it as the
    last turn (after the generation prompt) that the full text has there: all of it where the
    template renders history as it renders the last turn; without the parts it drops from
    history (Qwen3's think block) otherwise, so a turn of tool calls alone keeps its calls.
    A tail that misses the content falls back to the content and its end-of-turn marker (the
    non-space run the template puts right after the content). TemplateError when a turn's
    content is not in the rendering (a template that rewrites contents)."""
    bodies = [(m.get("content") or "").strip() for m in messages]
    spans: list[tuple[int, int, int]] = []
    user_starts: list[int] = []
    cursor, last_end = 0, None
    for i, m in enumerate(messages):
        if m["role"] == "user" and i > 0 and messages[i - 1]["role"] == "assistant":
            p = cursor if last_end is None else last_end
            user_starts.append(p + len(text[p:]) - len(text[p:].lstrip()))
        last_end, body = None, bodies[i]
        at = text.find(body, cursor) if body else cursor
        if m["role"] not in loss_roles:
            cursor = at + len(body) if at >= 0 else cursor
            continue
        if at < 0:
            raise TemplateError(
                f"the chat template rewrites earlier turns and message {i}'s content is not "
                "in its rendering, so reply tokens cannot be located"
            )
        nxt = next((bodies[j] for j in range(i + 1, len(messages)) if bodies[j]), "")
        stop = text.find(nxt, at + len(body)) if nxt else len(text)
        stop = len(text) if stop < 0 else stop
        head = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        alone = render(tokenizer, messages[: i + 1])
        own = alone[len(head) :].rstrip() if alone.startswith(head) else ""
        lo, hi = 0, len(own)  # the longest tail of `own` in text[cursor:stop] (monotone)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if text.find(own[-mid:], cursor, stop) >= 0 else (lo, mid - 1)
        a = text.find(own[len(own) - lo :], cursor, stop) if lo else -1
        b = a + lo
        q = alone.rfind(body) if body else -1
        marker = _NON_SPACE.match(alone, q + len(body)).group() if q >= 0 else ""
        if a >= 0:
            a += len(text[a:b]) - len(text[a:b].lstrip())
        if a < 0 or (body and body not in text[a:b]) or len(text[a:b]) <= len(marker):
            if not body:
                continue  # nothing of this turn found to learn
            a, b = at, at + len(body)
            if marker and text.startswith(marker, b):
                b += len(marker)
        spans.append((i, a, b))
        cursor = last_end = b
    return spans, user_starts


def mask_from_offsets(
    text: str, offsets: list[tuple[int, int]], spans: list[tuple[int, int]]
) -> list[int]:
    """1 for tokens whose first non-space character lies inside one of `spans`.

    Vectorised: a token overlapping a span is in it, except a token that starts before the
    span with non-space characters (a header piece merged into the reply's first token).
    SentencePiece glues the header's trailing space onto the first reply word; that token counts.
    """
    if not spans or not offsets:
        return [0] * len(offsets)
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    s, e = off[:, 0], off[:, 1]
    starts, ends = np.array(spans).T
    k = np.searchsorted(ends, s, side="right")  # first span that ends after the token starts
    valid = k < len(spans)
    kk = np.minimum(k, len(spans) - 1)
    mask = valid & (e > s) & (e > starts[kk])
    for t in np.nonzero(mask & (s < starts[kk]))[0]:
        if text[s[t] : starts[kk[t]]].strip():
            mask[t] = False
    return mask.astype(np.int8).tolist()


def char_to_token(offsets: list[tuple[int, int]], pos: int) -> int:
    """Index of the first token that starts at or after char `pos`."""
    starts = [s for s, _ in offsets]
    return bisect.bisect_left(starts, pos)


_PLACEHOLDER = "\ue000{}\ue001"  # private-use chars: never produced by a chat template
_SKELETONS: dict[tuple, tuple | None] = {}


def _skeleton(tokenizer, roles: tuple[str, ...], loss_roles: tuple[str, ...]):
    """Spans of a conversation with these roles and placeholder contents, computed once.

    Returns (text, spans, user_starts, placeholder positions) or None when the template cannot
    be laid out this way (then every conversation takes the exact per-turn path).
    """
    key = (id(tokenizer), tokenizer.chat_template, roles, loss_roles)
    if key not in _SKELETONS:
        if len(_SKELETONS) > 4096:
            _SKELETONS.clear()
        msgs = [{"role": r, "content": _PLACEHOLDER.format(i)} for i, r in enumerate(roles)]
        try:
            text, spans, starts = _turn_spans(tokenizer, msgs, loss_roles)
            pos = [text.find(m["content"]) for m in msgs]
            ok = all(p >= 0 for p in pos) and pos == sorted(pos)
            ok = ok and all(text.count(m["content"]) == 1 for m in msgs)
            _SKELETONS[key] = (text, spans, starts, pos) if ok else None
        except TemplateError:
            _SKELETONS[key] = None
    return _SKELETONS[key]


def fast_turn_spans(tokenizer, messages, loss_roles):
    """_turn_spans() from a cached skeleton plus one render; None when it does not apply.

    Chat templates are usually content-independent: the real text is the skeleton with each
    placeholder replaced by its content, so every char position shifts by the length change of
    the placeholders before it. One render of the real conversation verifies that assumption
    (templates that trim or inspect content fail it and take the exact path). Turns with more
    than role and content (tool calls, reasoning) always take the exact path.
    """
    if any(len(m) != 2 for m in messages):
        return None
    sk = _skeleton(tokenizer, tuple(m["role"] for m in messages), loss_roles)
    if sk is None:
        return None
    sk_text, sk_spans, sk_starts, pos = sk
    text = render(tokenizer, messages)
    parts, prev = [], 0
    ends, deltas = [], []
    for i, (p, m) in enumerate(zip(pos, messages, strict=True)):
        ph = _PLACEHOLDER.format(i)
        parts += [sk_text[prev:p], m["content"]]
        prev = p + len(ph)
        ends.append(prev)
        deltas.append(len(m["content"]) - len(ph))
    parts.append(sk_text[prev:])
    if "".join(parts) != text:
        return None
    cum = np.concatenate([[0], np.cumsum(deltas)])

    def shift(x: int) -> int:
        return x + int(cum[bisect.bisect_right(ends, x)])

    spans = []
    for i, a, b in sk_spans:
        a2, b2 = shift(a), shift(b)
        while b2 > a2 and text[b2 - 1].isspace():  # as loss_spans: no trailing whitespace
            b2 -= 1
        if b2 > a2:
            spans.append((i, a2, b2))
    return text, spans, [shift(x) for x in sk_starts]


def mask_from_encoding(text: str, enc, spans: list[tuple[int, int]]) -> list[int] | None:
    """mask_from_offsets() using the fast tokenizer's char->token index: slices, not a loop."""
    offsets = enc.offsets
    n = len(offsets)
    mask = [0] * n
    for a, b in spans:
        t0 = enc.char_to_token(a)
        t1 = enc.char_to_token(b - 1)
        if t0 is None or t1 is None:
            return None
        while t1 + 1 < n and offsets[t1 + 1][0] < b and offsets[t1 + 1][1] > offsets[t1 + 1][0]:
            t1 += 1  # further tokens of the same char (byte-level pieces of one character)
        if offsets[t0][0] < a and text[offsets[t0][0] : a].strip():
            t0 += 1  # a header piece merged into the first reply token stays context
        if t1 >= t0:
            mask[t0 : t1 + 1] = [1] * (t1 + 1 - t0)
    return mask


REASONING_MODES = ("train", "mask", "drop")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_READS_REASONING = re.compile(r"\b(reasoning_content|thinking)\b")
_CLOSING_TAG = re.compile(r"\s*</[^<>\s]{1,32}>\s*|\s+")


def mask_method(tokenizer, loss_roles: tuple[str, ...] = ("assistant",)) -> str:
    """How loss spans are found: "generation" when the chat template marks assistant output
    with `{% generation %}` blocks (what transformers' `return_assistant_tokens_mask` reads) and
    only assistant turns carry loss; otherwise "spans" (rendering growing prefixes)."""
    template = getattr(tokenizer, "chat_template", None)
    marked = isinstance(template, str) and _GENERATION.search(template) is not None
    return "generation" if marked and tuple(loss_roles) == ("assistant",) else "spans"


def template_messages(tokenizer, messages: list[dict], reasoning: str = "train") -> list[dict]:
    """The messages as the chat template gets them. reasoning=drop removes reasoning. A template
    that does not read `reasoning_content` gets it inlined as a leading `<think>` block of the
    reply, and one that does not read `tool_calls` gets the calls appended to the reply as
    `<tool_call>{json}</tool_call>` (Hermes / Qwen style): otherwise they would vanish."""
    template = getattr(tokenizer, "chat_template", None) or ""
    inline_reasoning = not _READS_REASONING.search(template)
    inline_calls = "tool_calls" not in template
    out = []
    for m in messages:
        if len(m) == 2:  # a plain turn: role and content
            out.append(m)
            continue
        m = dict(m)
        if inline_calls and m.get("tool_calls"):
            calls = [
                "<tool_call>\n" + json.dumps(c["function"], ensure_ascii=False) + "\n</tool_call>"
                for c in m.pop("tool_calls")
            ]
            m["content"] = "\n".join([m["content"]] * bool(m["content"]) + calls)
        r = m.pop("reasoning_content", None) if reasoning == "drop" or inline_reasoning else None
        if r and reasoning != "drop":
            m["content"] = f"<think>\n{r}\n</think>\n\n{m['content']}"
        out.append(m)
    return out


def _generation_spans(
    tokenizer, messages: list[dict]
) -> tuple[str, list[tuple[int, int, int]], list[int]]:
    """_turn_spans() from the template's own `{% generation %}` blocks, one per assistant turn
    in order (as transformers' `apply_chat_template(return_assistant_tokens_mask=True)`).
    A user turn after an assistant turn starts, for splitting, where that turn's block ends
    (whitespace skipped)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, indices = render_jinja_template(
            conversations=[messages],
            chat_template=tokenizer.chat_template,
            return_assistant_tokens_mask=True,
            **tokenizer.special_tokens_map,
        )
    except Exception as e:  # a template that raises on this conversation (jinja's own errors)
        raise TemplateError(f"the chat template fails on this conversation: {e}") from e
    text, blocks = rendered[0], indices[0]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(blocks) != len(turns):
        raise TemplateError(
            f"the chat template's {{% generation %}} blocks ({len(blocks)}) do not match the "
            f"assistant turns ({len(turns)}), so reply tokens cannot be assigned to turns"
        )
    spans = [(i, a, b) for i, (a, b) in zip(turns, blocks, strict=True) if b > a]
    ends = dict(zip(turns, (b for _, b in blocks), strict=True))
    user_starts = []
    for i, m in enumerate(messages):
        if m["role"] == "user" and i > 0 and messages[i - 1]["role"] == "assistant":
            p = ends[i - 1]
            user_starts.append(p + len(text[p:]) - len(text[p:].lstrip()))
    return text, spans, user_starts


def select_spans(
    text: str,
    messages: list[dict],
    spans: list[tuple[int, int, int]],
    reasoning: str = "train",
    last_turn_only: bool = False,
) -> list[tuple[int, int]]:
    """The char spans that carry loss, from per-message spans (i, start, end).

    last_turn_only: only messages after the last user turn (the final reply, with its tool
    calls and the replies after their results). reasoning=mask: the span of a turn with
    reasoning starts after the reasoning block (its text, then a closing tag such as
    `</think>` and whitespace), so the reasoning and its tags are context only.
    """
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = []
    for i, a, b in spans:
        if last_turn_only and i < last_user:
            continue
        r = messages[i].get("reasoning_content") if reasoning == "mask" else None
        p = text.find(r, a, b) if r else -1
        if p >= 0:
            tag = _CLOSING_TAG.match(text, p + len(r))
            a = min(b, tag.end() if tag else p + len(r))
        if b > a:
            out.append((a, b))
    return out


def encode_batch(
    tokenizer,
    conversations: list[list[dict]],
    loss_roles: tuple[str, ...],
    reasoning: str = "train",
    last_turn_only: bool = False,
    method: str | None = None,
) -> list[Encoded | TemplateError]:
    """Tokenize many conversations in one fast-tokenizer call and build their loss masks.

    `method` (default: mask_method()) is "generation" or "spans"; `reasoning` (train, mask,
    drop) and `last_turn_only` as select_spans() and template_messages().
    """
    if reasoning not in REASONING_MODES:
        raise ValueError(f"reasoning={reasoning!r}: one of {', '.join(REASONING_MODES)}")
    method = method or mask_method(tokenizer, loss_roles)
    rendered: list[tuple[str, list, list] | TemplateError] = []
    for msgs in conversations:
        tmsgs = template_messages(tokenizer, msgs, reasoning)
        try:
            if method == "generation":
                text, spans, starts = _generation_spans(tokenizer, tmsgs)
            else:
                text, spans, starts = fast_turn_spans(tokenizer, tmsgs, loss_roles) or _turn_spans(
                    tokenizer, tmsgs, loss_roles
                )
            spans = select_spans(text, msgs, spans, reasoning, last_turn_only)
            rendered.append((text, spans, starts))
        except TemplateError as e:
            rendered.append(e)
    texts = [r[0] for r in rendered if not isinstance(r, TemplateError)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not texts:
        encodings = []
    elif backend is not None and backend.truncation is None and backend.padding is None:
        encodings = backend.encode_batch(texts, add_special_tokens=False)
    else:
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        pairs = zip(enc["input_ids"], enc["offset_mapping"], strict=True)
        encodings = [_Slow(ids, offsets) for ids, offsets in pairs]
    out: list[Encoded | TemplateError] = []
    encoded = iter(encodings)
    for r in rendered:
        if isinstance(r, TemplateError):
            out.append(r)
            continue
        text, spans, user_starts = r
        e = next(encoded)
        fast = not isinstance(e, _Slow)  # a tokenizers Encoding maps chars to tokens itself
        mask = mask_from_encoding(text, e, spans) if fast else None
        offsets = None
        if mask is None:
            offsets = e.offsets
            mask = mask_from_offsets(text, offsets, spans)
        starts = [e.char_to_token(p) if fast else None for p in user_starts]
        if any(t is None for t in starts):
            offsets = offsets or e.offsets
            starts = [char_to_token(offsets, p) for p in user_starts]
        out.append(Encoded(list(e.ids), mask, starts))
    return out


def generated_encoding(enc: Encoded, ids: list[int], reply_at: list[int]) -> Encoded | str:
    """The sample of a regenerated conversation as the base ran it: `ids`, its last turn's
    prompt + the reply's token ids as generated (`ids[start:end]`, reply_at = [start, end]) +
    the template's tail, with `enc`'s loss mask (the conversation's text tokenized) on the
    prompt and tail, and on the reply the mask the text's reply has.

    Where the two cannot be lined up, the reason instead: `prompt` (the text's tokens do not
    start with the prompt), `tail` (nor end with the tail), `mask` (the text's reply is partly
    masked, e.g. reasoning=mask masks its think block: which generated tokens that covers is
    not known)."""
    start, end = reply_at
    tail = ids[end:]
    n = len(enc.input_ids)
    if n < start + len(tail) or enc.input_ids[:start] != ids[:start]:
        return "prompt"
    if tail and enc.input_ids[n - len(tail) :] != tail:
        return "tail"
    reply_mask = set(enc.loss_mask[start : n - len(tail)])
    if len(reply_mask) > 1:
        return "mask"
    fill = reply_mask.pop() if reply_mask else 1
    mask = enc.loss_mask[:start] + [fill] * (end - start) + enc.loss_mask[n - len(tail) :]
    starts = [t for t in enc.turn_starts if t is not None and t <= start]
    return Encoded(list(ids), mask, starts)


class _Slow:
    """ids + offsets from a tokenizer without a Rust backend, shaped like a tokenizers Encoding."""

    def __init__(self, ids, offsets):
        self.ids, self.offsets = ids, offsets


def chunk(enc: Encoded, max_length: int, mode: str) -> list[tuple[list[int], list[int]]] | str:
    """Fit one conversation into `max_length` tokens: a list of (input_ids, loss_mask) pieces,
    or the skip reason 'too_long' (mode=drop).

    truncate: keep the first max_length tokens. split: cut at user-turn starts so each piece
    begins with a user turn; a single exchange longer than max_length is cut hard.
    """
    ids, mask = enc.input_ids, enc.loss_mask
    n = len(ids)
    if n <= max_length:
        return [(ids, mask)]
    if mode == "drop":
        return "too_long"
    if mode == "truncate":
        return [(ids[:max_length], mask[:max_length])]
    pieces = []
    start = 0
    bounds = [b for b in enc.turn_starts if 0 < b < n] + [n]
    while start < n:
        fits = [b for b in bounds if start < b <= start + max_length]
        stop = fits[-1] if fits else min(start + max_length, n)
        pieces.append((ids[start:stop], mask[start:stop]))
        start = stop
    return pieces
