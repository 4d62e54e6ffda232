"""Apply the base model's chat template and mark the tokens that carry loss (assistant replies)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


class TemplateError(ValueError):
    """The chat template cannot be used to locate turns (e.g. it rewrites earlier turns)."""


@dataclass
class Encoded:
    """One tokenized conversation."""

    input_ids: list[int]
    loss_mask: list[int]
    # Token index where each user turn after the first starts: safe places to split.
    turn_starts: list[int]


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def loss_spans(
    tokenizer, messages: list[dict[str, str]], loss_roles: tuple[str, ...] = ("assistant",)
) -> tuple[str, list[tuple[int, int]], list[int]]:
    """Render `messages`; return (text, char spans that carry loss, char starts of user turns).

    The span of message i is what rendering messages[: i + 1] adds to rendering messages[:i]
    followed by the generation prompt: the reply and its end-of-turn token, without the
    assistant header. Trailing whitespace after the end-of-turn token is left out. This works
    for any template whose renderings of a growing conversation are prefixes of each other.
    """
    text = render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
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
                spans.append((len(head), end))
        prev = full
    return text, spans, user_starts


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
    starts = np.array([a for a, _ in spans])
    ends = np.array([b for _, b in spans])
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


def encode_batch(
    tokenizer, conversations: list[list[dict[str, str]]], loss_roles: tuple[str, ...]
) -> list[Encoded | TemplateError]:
    """Tokenize many conversations in one fast-tokenizer call and build their loss masks."""
    rendered: list[tuple[str, list, list] | TemplateError] = []
    for msgs in conversations:
        try:
            rendered.append(loss_spans(tokenizer, msgs, loss_roles))
        except TemplateError as e:
            rendered.append(e)
    texts = [r[0] for r in rendered if not isinstance(r, TemplateError)]
    enc = (
        tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        if texts
        else {"input_ids": [], "offset_mapping": []}
    )
    out: list[Encoded | TemplateError] = []
    j = 0
    for r in rendered:
        if isinstance(r, TemplateError):
            out.append(r)
            continue
        text, spans, user_starts = r
        ids = enc["input_ids"][j]
        offsets = enc["offset_mapping"][j]
        j += 1
        mask = mask_from_offsets(text, offsets, spans)
        out.append(Encoded(list(ids), mask, [char_to_token(offsets, p) for p in user_starts]))
    return out


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
