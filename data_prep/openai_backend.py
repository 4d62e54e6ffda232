"""Regeneration through an OpenAI-compatible chat-completions server (`regen.backend=openai`).

vLLM, SGLang, TGI and llama.cpp's server all answer POST <url>/chat/completions. A turn step's
histories go out `regen.concurrency` at a time (a thread pool over one httpx client), each as
the chat so far; the server applies the model's chat template and returns the reply's text.

Failures, per request:
- An HTTP 429 or 5xx, a reply that is not chat-completions JSON, an empty reply or a timeout is
  asked again, up to `regen.retries` times, after `regen.backoff_s` doubled each time. If it still
  fails, the conversation ends before that turn, with the reason (`regen_<reason>` when it
  leaves the conversation no turn at all): it is never written as data.
- Another 4xx (a bad request, a prompt longer than the server's context) is not retried.
- A server that cannot be reached (connection refused or reset) after the retries stops the run
  with RegenError: the shard in progress is not written, so a re-run resumes there and nothing
  is counted as bad data because the server was down.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from data_prep.config import RegenConfig, RegenError

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class EndpointDown(RuntimeError):
    """The server did not answer at all (after the retries)."""


def _headers(cfg: RegenConfig) -> dict[str, str]:
    if not cfg.api_key_env:
        return {}
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise RegenError(
            f"regen.api_key_env={cfg.api_key_env} but that environment variable is not set: "
            f"export {cfg.api_key_env}=... or set regen.api_key_env=null for a server without keys"
        )
    return {"Authorization": f"Bearer {key}"}


def _request(client, cfg: RegenConfig, messages: list[dict]) -> tuple[str | None, str]:
    """One reply: (text, "") or (None, the reason it failed after the retries)."""
    import httpx

    body = {
        "model": cfg.model,
        "messages": messages,
        "max_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
    }
    reason, down, empty = "", False, False
    for attempt in range(cfg.retries + 1):
        if attempt:
            time.sleep(cfg.backoff_s * 2 ** (attempt - 1))
        down = False
        try:
            r = client.post("/chat/completions", json=body)
        except httpx.TimeoutException:
            reason = "timeout"
            continue
        except httpx.TransportError as e:  # refused, reset, closed mid-reply
            reason, down = f"unreachable ({type(e).__name__})", True
            continue
        if r.status_code != 200:
            reason = f"http_{r.status_code}"
            if r.status_code in RETRYABLE_STATUS:
                continue
            return None, reason
        try:
            content = r.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            reason = "malformed_reply"
            continue
        if not isinstance(content, str):
            reason = "malformed_reply"
            continue
        if not content.strip():
            reason, empty = "empty_reply", True
            continue
        return content, ""
    if down:
        raise EndpointDown(reason)
    # what the server answered, if it ever did, over a transient failure of the last attempt
    return None, "empty_reply" if empty else reason


def wire_messages(history: list[dict]) -> list[dict]:
    """A history in the chat-completions wire format: tool-call arguments as JSON strings, each
    call with an id (`call_<turn>_<n>` where the data had none) and each tool result answering
    one (`tool_call_id`, the calls' ids in order where the data gave none). Reasoning is left
    out: servers disagree on its field, and most chat templates drop it from past turns."""
    out, pending = [], []
    for j, m in enumerate(history):
        w = {k: v for k, v in m.items() if k != "reasoning_content"}
        if m.get("tool_calls"):
            calls = []
            for n, c in enumerate(m["tool_calls"]):
                fn = c["function"]
                args = fn["arguments"]
                calls.append(
                    {
                        "id": c.get("id") or f"call_{j}_{n}",
                        "type": "function",
                        "function": {
                            "name": fn["name"],
                            "arguments": args if isinstance(args, str) else json.dumps(args),
                        },
                    }
                )
            w["tool_calls"] = calls
            pending = [c["id"] for c in calls]
        elif m["role"] == "tool":
            given = w.get("tool_call_id")
            if given in pending:
                pending.remove(given)
            elif not given:
                w["tool_call_id"] = pending.pop(0) if pending else f"call_{j}"
        out.append(w)
    return out


def chat_replies(histories: list[list[dict]], cfg: RegenConfig) -> list[tuple[str | None, str]]:
    """Every history's reply (text, "") or (None, reason), in order."""
    import httpx

    if not histories:
        return []
    histories = [wire_messages(h) for h in histories]
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 10.0))
    limits = httpx.Limits(max_connections=cfg.concurrency)
    url = cfg.url.rstrip("/")
    with (
        httpx.Client(base_url=url, timeout=timeout, limits=limits, headers=_headers(cfg)) as client,
        ThreadPoolExecutor(cfg.concurrency) as pool,
    ):
        try:
            return list(pool.map(lambda m: _request(client, cfg, m), histories))
        except EndpointDown as e:
            raise RegenError(
                f"the regeneration server at {url} stopped answering ({e}, after "
                f"{cfg.retries} retries): start it again and re-run the same command; the "
                "finished shards are kept and the run resumes at the shard it was on"
            ) from None
