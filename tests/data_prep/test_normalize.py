"""Normalization: role variants map onto system/user/assistant; irregular rows get a reason."""

from __future__ import annotations

import pytest

from data_prep.normalize import NormalizeStats, RowError, conversation_key, normalize


def test_role_variants_and_message_formats():
    rec = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "q"},
            {"from": "chatgpt", "value": "a"},
            {"from": "user", "value": "q2"},
            {"from": "bard", "value": "a2"},
        ]
    }
    assert [m["role"] for m in normalize(rec)] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert normalize(rec) == rec["messages"]
    assert normalize({"prompt": "q", "response": "a"}) == rec["messages"]


def test_leading_assistant_and_trailing_user_turns_are_dropped_and_counted():
    stats = NormalizeStats()
    rec = {
        "conversations": [
            {"from": "gpt", "value": "orphan"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
            {"from": "human", "value": "tail"},
        ]
    }
    assert [m["content"] for m in normalize(rec, stats=stats)] == ["q", "a"]
    assert stats.leading_assistant_turns_dropped == 1
    assert stats.trailing_user_turns_dropped == 1


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"conversations": []}, "empty"),
        ({"conversations": [{"from": "human", "value": None}]}, "non_string_content"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown_role"),
        ({"conversations": [{"from": "human", "value": "x"}]}, "no_assistant_turn"),
        (
            {
                "conversations": [
                    {"from": "human", "value": "x"},
                    {"from": "human", "value": "y"},
                    {"from": "gpt", "value": "z"},
                ]
            },
            "non_alternating",
        ),
        (
            {"conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": "z"}]},
            "empty_turn",
        ),
        ({"conversations": "text"}, "malformed_turns"),
        ({"conversations": ["text"]}, "malformed_turns"),
        ({"text": "x"}, "no_conversation"),
        ("a string", "not_an_object"),
    ],
)
def test_bad_rows_raise_with_reason(record, reason):
    with pytest.raises(RowError) as e:
        normalize(record)
    assert e.value.reason == reason


def test_custom_field_and_role_map():
    rec = {"dialog": [{"role": "Customer", "content": "q"}, {"role": "Agent", "content": "a"}]}
    roles = {"customer": "user", "agent": "assistant"}
    assert [m["role"] for m in normalize(rec, roles, "dialog")] == ["user", "assistant"]


def test_conversation_key_is_content_based():
    a = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    b = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]
    assert conversation_key(a) == conversation_key([dict(m) for m in a])
    assert conversation_key(a) != conversation_key(b)
