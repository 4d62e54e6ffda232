"""Turn raw chat records (ShareGPT, OpenAI messages, prompt/response) into canonical messages."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Role names seen in the wild, mapped to the three roles chat templates know.
DEFAULT_ROLE_MAP: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
ROLES = ("system", "user", "assistant")


class RowError(ValueError):
    """A record that cannot become a training conversation; `reason` is its skip-count key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason
        self.detail = detail


@dataclass
class NormalizeStats:
    """What normalization changed without dropping the conversation."""

    leading_assistant_turns_dropped: int = 0
    trailing_user_turns_dropped: int = 0


def _turns(record: Any, field_name: str | None) -> list:
    """The list of turns in `record` (ShareGPT, OpenAI messages, or prompt/response)."""
    if not isinstance(record, Mapping):
        raise RowError("not_an_object", f"record is a {type(record).__name__}, not an object")
    names = [field_name] if field_name else ["conversations", "messages", "conversation"]
    for name in names:
        if name in record:
            turns = record[name]
            if not isinstance(turns, list):
                raise RowError("malformed_turns", f"'{name}' is a {type(turns).__name__}")
            return turns
    if "prompt" in record and ("response" in record or "completion" in record):
        reply = record.get("response", record.get("completion"))
        return [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": reply},
        ]
    raise RowError("no_conversation", f"no field {' / '.join(names)} (keys: {sorted(record)[:8]})")


def normalize(
    record: Any,
    role_map: Mapping[str, str] = DEFAULT_ROLE_MAP,
    field_name: str | None = None,
    stats: NormalizeStats | None = None,
) -> list[dict[str, str]]:
    """Canonical `[{"role": system|user|assistant, "content": str}, ...]` or a RowError.

    Conversations must alternate user/assistant after an optional leading system turn. Leading
    assistant turns (ShareGPT has thousands of conversations that start mid-way) and trailing
    user turns without a reply are dropped and counted; anything else irregular rejects the row.
    """
    turns = _turns(record, field_name)
    if not turns:
        raise RowError("empty", "conversation has no turns")
    msgs: list[dict[str, str]] = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise RowError("malformed_turns", f"turn {j} is a {type(turn).__name__}")
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if not isinstance(role, str):
            raise RowError("malformed_turns", f"turn {j} has no string 'from'/'role'")
        mapped = role_map.get(role.strip().lower())
        if mapped is None:
            raise RowError("unknown_role", f"turn {j} role {role!r}")
        if not isinstance(content, str):
            raise RowError("non_string_content", f"turn {j} content is {type(content).__name__}")
        msgs.append({"role": mapped, "content": content})

    system = [m for m in msgs[:1] if m["role"] == "system"]
    body = msgs[len(system) :]
    dropped_lead = 0
    while body and body[0]["role"] == "assistant":
        body.pop(0)
        dropped_lead += 1
    dropped_tail = 0
    while body and body[-1]["role"] == "user":
        body.pop()
        dropped_tail += 1
    if not body:
        raise RowError("no_assistant_turn", "no user turn followed by an assistant reply")
    for j, m in enumerate(body):
        want = "user" if j % 2 == 0 else "assistant"
        if m["role"] != want:
            raise RowError("non_alternating", f"turn {j} is {m['role']}, expected {want}")
        if not m["content"].strip():
            raise RowError("empty_turn", f"{m['role']} turn {j} is empty")
    if stats is not None:
        stats.leading_assistant_turns_dropped += dropped_lead
        stats.trailing_user_turns_dropped += dropped_tail
    return system + body


def conversation_key(messages: list[dict[str, str]]) -> str:
    """Stable hash of a conversation's content: the dedup key and the split key."""
    blob = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
