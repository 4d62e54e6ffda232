"""Turn raw chat records (ShareGPT, OpenAI messages, prompt/response) into canonical messages."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from train.core.readers import DEFAULT_ROLE_MAP

# Role names seen in the wild, mapped to the roles chat templates know (ROLES).
# "tool": a tool's result, answering an assistant turn's `tool_calls` (OpenAI messages).
ROLES = ("system", "user", "assistant", "tool")
# Where datasets put an assistant turn's reasoning (transformers reads all three names).
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
# A reasoning block at the start of an assistant reply (Qwen3, DeepSeek-R1 style).
_THINK = re.compile(r"\s*<think>(.*?)</think>\s*", re.DOTALL)


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


def _tool_calls(calls: Any, j: int) -> list[dict]:
    """An assistant turn's `tool_calls`, canonical: [{"type": "function", "function": {"name",
    "arguments": dict}, "id"?}]. Arguments given as a JSON string are parsed: most templates
    write them with `| tojson`, which would quote a string a second time."""
    if not isinstance(calls, list):
        raise RowError("bad_tool_call", f"turn {j} tool_calls is a {type(calls).__name__}")
    out = []
    for c, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name.strip():
            raise RowError("bad_tool_call", f"turn {j} tool call {c} has no function name")
        args = fn.get("arguments", fn.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise RowError(
                    "bad_tool_call", f"turn {j} tool call {c} arguments are not JSON"
                ) from None
        if not isinstance(args, Mapping):
            raise RowError("bad_tool_call", f"turn {j} tool call {c} arguments are not an object")
        canon: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(call.get("id"), str):
            canon["id"] = call["id"]
        out.append(canon)
    return out


def _assistant_fields(turn: Mapping, content: Any, j: int) -> tuple[Any, dict[str, Any]]:
    """(content, extra fields) of an assistant turn: tool calls, and reasoning from a
    reasoning field or a leading `<think>...</think>` block of the content."""
    extra: dict[str, Any] = {}
    calls = turn.get("tool_calls")
    if calls:  # null and [] both mean "no call"
        extra["tool_calls"] = _tool_calls(calls, j)
        if content is None:  # OpenAI: content is null on a turn that only calls tools
            content = ""
    reasoning = next((turn[k] for k in REASONING_FIELDS if turn.get(k) is not None), None)
    if reasoning is not None and not isinstance(reasoning, str):
        raise RowError("non_string_content", f"turn {j} reasoning is {type(reasoning).__name__}")
    if isinstance(content, str):
        m = _THINK.match(content)
        if m:
            if reasoning and reasoning.strip():
                raise RowError(
                    "reasoning_twice", f"turn {j} has both a reasoning field and a <think> block"
                )
            reasoning, content = m.group(1), content[m.end() :]
        elif content.lstrip().startswith("<think>"):
            raise RowError("unclosed_think", f"turn {j} opens <think> and never closes it")
    if reasoning and reasoning.strip():
        extra["reasoning_content"] = reasoning.strip()
    return content, extra


def _check_order(body: list[dict[str, Any]]) -> None:
    """user -> assistant, then user again, or (after an assistant turn with tool_calls) one or
    more tool results and another assistant turn. Raises RowError naming what is wrong."""
    prev = None
    ids: set[str] | None = None  # ids of the open tool calls (None: no call to answer)
    for j, m in enumerate(body):
        role = m["role"]
        if role == "tool":
            if ids is None:
                raise RowError(
                    "tool_result_without_call",
                    f"turn {j} is a tool result, but no assistant tool call precedes it",
                )
            tid = m.get("tool_call_id")
            if ids and tid is not None and tid not in ids:
                raise RowError(
                    "tool_result_unknown_call",
                    f"turn {j} answers tool_call_id {tid!r}, not one of {sorted(ids)}",
                )
        elif role == "user" and prev == "assistant" and ids is not None:
            raise RowError(
                "tool_call_without_result",
                f"turn {j} is user, but the tool calls of the turn before have no result",
            )
        elif role == "user" and prev not in (None, "assistant"):
            raise RowError("non_alternating", f"turn {j} is user, expected assistant")
        elif role == "assistant" and prev not in ("user", "tool"):
            raise RowError("non_alternating", f"turn {j} is assistant, expected user")
        elif role == "system":
            want = "user" if prev in (None, "assistant") else "assistant"
            raise RowError("non_alternating", f"turn {j} is system, expected {want}")
        if role != "tool" and not m["content"].strip() and not m.get("tool_calls"):
            raise RowError("empty_turn", f"{role} turn {j} is empty")
        if role == "assistant":
            calls = m.get("tool_calls")
            ids = {c["id"] for c in calls if "id" in c} if calls else None
        elif role == "user":
            ids = None
        prev = role


def normalize(
    record: Any,
    role_map: Mapping[str, str] = DEFAULT_ROLE_MAP,
    field_name: str | None = None,
    stats: NormalizeStats | None = None,
) -> list[dict[str, Any]]:
    """Canonical `[{"role": system|user|assistant|tool, "content": str, ...}, ...]` or a
    RowError.

    Conversations must alternate user/assistant after an optional leading system turn; an
    assistant turn with `tool_calls` may be followed by `tool` results (optional
    `tool_call_id`, `name`) and another assistant turn. Reasoning (`reasoning_content`, or a
    leading `<think>...</think>` block of the reply) moves to the turn's "reasoning_content".
    Plain turns keep exactly {"role", "content"}: their conversation keys do not change.
    Leading assistant turns (ShareGPT has thousands of conversations that start mid-way, with
    the tool results answering them) and trailing user or tool turns without a reply are
    dropped and counted; anything else irregular rejects the row.
    """
    turns = _turns(record, field_name)
    if not turns:
        raise RowError("empty", "conversation has no turns")
    msgs: list[dict[str, Any]] = []
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
        extra: dict[str, Any] = {}
        if mapped == "assistant":
            content, extra = _assistant_fields(turn, content, j)
        elif mapped == "tool":
            for k in ("tool_call_id", "name"):
                if isinstance(turn.get(k), str):
                    extra[k] = turn[k]
        if not isinstance(content, str):
            raise RowError("non_string_content", f"turn {j} content is {type(content).__name__}")
        msgs.append({"role": mapped, "content": content, **extra})

    system = [m for m in msgs[:1] if m["role"] == "system"]
    body = msgs[len(system) :]
    dropped_lead = 0
    while body and body[0]["role"] == "assistant":
        calls = "tool_calls" in body.pop(0)
        dropped_lead += 1
        while calls and body and body[0]["role"] == "tool":
            body.pop(0)  # the results of a dropped call go with it
    dropped_tail = 0
    while body and body[-1]["role"] in ("user", "tool"):
        body.pop()
        dropped_tail += 1
    if not body:
        raise RowError("no_assistant_turn", "no user turn followed by an assistant reply")
    _check_order(body)
    if stats is not None:
        stats.leading_assistant_turns_dropped += dropped_lead
        stats.trailing_user_turns_dropped += dropped_tail
    return system + body


def conversation_key(messages: list[dict[str, str]]) -> str:
    """Stable hash of a conversation's content: the dedup key and the split key."""
    blob = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def pack_extras(msgs: list[dict]) -> str:
    """Each turn's fields beyond role and content (tool calls, tool_call_id, reasoning) as one
    JSON list, or "" for a plain chat (most rows: nothing to store or parse). A conversation row
    keeps roles, contents and this string (Arrow columns of one type)."""
    extra = [{k: v for k, v in m.items() if k not in ("role", "content")} for m in msgs]
    return json.dumps(extra, ensure_ascii=False) if any(extra) else ""


def unpack_messages(roles: list[str], contents: list[str], extras: str | None) -> list[dict]:
    """A conversation row's fields -> its messages (the inverse of pack_extras)."""
    msgs = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
    if extras:
        for m, e in zip(msgs, json.loads(extras), strict=True):
            m.update(e)
    return msgs
