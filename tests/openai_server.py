"""A small OpenAI-compatible chat-completions server for the tests (aiohttp): it serves a base
model (tiny_random by default) with greedy `generate`, and can misbehave on request.

    python -m tests.openai_server --port 0 --portfile PATH [--base tiny_random]
        [--malformed-every N] [--fail-every N] [--empty-if TEXT] [--die-after N] [--delay S]

--port 0 picks a free port and writes it to --portfile. Every Nth request gets a reply that is
not JSON (--malformed-every) or an HTTP 500 (--fail-every); a chat whose last message contains
TEXT always gets an empty reply; after N requests the process exits at once (--die-after), as a
crashed server would. GET /stats returns {"requests": n, "max_in_flight": k}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import torch
from aiohttp import web


def build_app(args) -> web.Application:
    from tests.helpers import base_config
    from train.core.base import load_base

    base = load_base(base_config(args.base))
    tok, model = base.tokenizer, base.model
    lock = asyncio.Lock()  # one generate at a time; requests still overlap while they wait
    stats = {"requests": 0, "in_flight": 0, "max_in_flight": 0}

    def generate(messages: list[dict], max_tokens: int) -> tuple[str, str]:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]  # fmt: skip
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or 0)  # fmt: skip
        new = out[0, ids.shape[1] :]
        finish = "length" if new.numel() >= max_tokens else "stop"
        return tok.decode(new, skip_special_tokens=True), finish

    async def chat(request: web.Request) -> web.Response:
        stats["requests"] += 1
        n = stats["requests"]
        if args.die_after and n > args.die_after:
            os._exit(3)  # a crash: no reply, the connection drops
        stats["in_flight"] += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        try:
            body = await request.json()
            await asyncio.sleep(args.delay)  # lets concurrent requests overlap
            if args.fail_every and n % args.fail_every == 0:
                return web.Response(status=500, text="internal error")
            if args.malformed_every and n % args.malformed_every == 0:
                return web.Response(status=200, text="{not json", content_type="application/json")
            msgs = body["messages"]
            if args.empty_if and args.empty_if in msgs[-1]["content"]:
                text, finish = "", "stop"
            else:
                async with lock:
                    text, finish = await asyncio.get_running_loop().run_in_executor(
                        None, generate, msgs, int(body.get("max_tokens") or 64)
                    )
            return web.json_response({
                "id": f"chatcmpl-{n}",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": finish,
                             "message": {"role": "assistant", "content": text}}],
            })  # fmt: skip
        finally:
            stats["in_flight"] -= 1

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response({k: stats[k] for k in ("requests", "max_in_flight")})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/stats", get_stats)
    return app


async def serve(args) -> None:
    runner = web.AppRunner(build_app(args))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    Path(args.portfile).write_text(str(port))
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--portfile", required=True)
    ap.add_argument("--base", default="tiny_random")
    ap.add_argument("--malformed-every", type=int, default=0)
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--empty-if", default="")
    ap.add_argument("--die-after", type=int, default=0)
    ap.add_argument("--delay", type=float, default=0.02)
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
