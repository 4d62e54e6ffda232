"""The left-padded strategy of the engine: plain batched generation for many prompts at once,
tuned for throughput (self-distillation, `hydra-heads prep regenerate=true`).

The decoder (train/decoding/decoder.py) right-pads and keeps each row's entries at the front of
its cache, which tree verification needs. Plain generation of many replies has other costs,
and this strategy answers them, on the same KVCache and sampling rules:

- Prefill in small groups. Rows are prefilled in groups of at most PREFILL_TOKENS padded tokens
  and PREFILL_PAD padding per row (a prompt longer than that alone, unpadded, so attention takes
  SDPA's causal kernel instead of a materialised rows x T x T mask), each left-padded, then
  copied right-aligned into the batch's cache (one copy per group, every layer at once).
- Left padding with the attention mask and explicit position ids (0 at each row's first real
  token): every row writes the same column each step, and a row's greedy reply is that of
  batch-1 `model.generate` up to float noise.
- Finished rows leave, in steps of ROW_STEP rows: once the rows still generating fit in fewer
  steps, the batch shrinks to them (plus finished rows as ballast up to a whole step), and the
  leading columns that are padding in every kept row are cut, so a long prompt that finished
  early stops costing attention. Measured at max_new_tokens=128 (most replies run to the
  limit) it changes nothing (48 rows, within 2%), and dropping rows one at a time was 15%
  slower on 16 rows: on this CPU a matmul over 13 rows takes longer than over 16. It is there
  for longer replies, whose lengths vary more.
- Its states, when asked (`tails`): the base's final hidden states over prompt, reply and the
  chat template's tail, which a finished row is fed before it leaves, so that hidden-state
  caching takes them instead of running the base over the same tokens again.
"""

from __future__ import annotations

import numpy as np
import torch

from train.decoding.backend import cache_kwarg, output_logits
from train.decoding.cache import new_cache
from train.decoding.sampling import sample_rows

# Padded tokens per prefill forward: on one CPU core SmolLM2's prefill throughput stops growing
# near 1k tokens per forward (~450 tokens/s), and this bounds a padded group's attention scores
# (rows x T x T).
PREFILL_TOKENS = 2048
# Padding a row by up to this many tokens costs less than the fixed cost of one more prefill
# forward (measured there: a batch-1 forward of 64 tokens runs at half the batched rate).
PREFILL_PAD = 64
# Finished rows leave the batch in whole steps of this many rows.
ROW_STEP = 8


def _left_pad(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """0 at each row's first real token (padding gets 0 too; it is masked anyway)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _forward(model, ids, mask, positions, cache, states: bool = False):
    """Logits (B, V) at the last position of `ids` (B, T), appending to `cache`; the lm_head
    runs on that position only. With `states`, also the final (post-norm) hidden states
    (B, T, H) of every position, else None."""
    out = model.model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **{cache_kwarg(type(model.model)): cache},
    )
    h = out.last_hidden_state
    return output_logits(model, h[:, -1]), (h if states else None)


def prefill_groups(prompts: list[list[int]]) -> list[list[int]]:
    """Prompt indices in prefill groups, longest first: a row joins while the group's padded
    size fits PREFILL_TOKENS and padding it costs less than another forward would."""
    groups: list[list[int]] = []
    for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
        g = groups[-1] if groups else None
        longest = len(prompts[g[0]]) if g else 0
        if (
            g
            and (len(g) + 1) * longest <= PREFILL_TOKENS
            and longest - len(prompts[i]) <= PREFILL_PAD
        ):
            g.append(i)
        else:
            groups.append([i])
    return groups


def _prefill(model, prompts, pad: int, capacity: int, states: bool = False):
    """Every prompt's cache, right-aligned at the longest prompt's width, the logits (B, V)
    after each prompt, and (`states`) each prompt's hidden states (len(p), H) as float32 on the
    CPU, else None."""
    device, rows = model.device, len(prompts)
    width = max(len(p) for p in prompts)
    cache, last = None, None
    kept: list[torch.Tensor] | None = [None] * rows if states else None  # type: ignore[list-item]
    for g in prefill_groups(prompts):
        ids, mask = _left_pad([prompts[i] for i in g], pad, device)
        group = new_cache(model, ids.shape[1])
        logits, h = _forward(model, ids, mask, _positions(mask), group, states)
        if cache is None:
            cache = new_cache(model, capacity)
            cache.allocate_like(group, rows)
            last = logits.new_empty(rows, logits.shape[-1])
        cache.insert(group, torch.tensor(g), width)
        last[g] = logits
        if kept is not None:
            h = h.float().cpu()
            for j, i in enumerate(g):  # left-padded: a prompt's tokens are its last columns
                kept[i] = h[j, h.shape[1] - len(prompts[i]) :].clone()  # not the group's
    cache.end = width
    return cache, last, kept


@torch.inference_mode()
def generate_left_padded(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: set[int],
    pad: int,
    temperature: float,
    top_p: float,
    tails: list[list[int] | None] | None = None,
):
    """Generate up to `max_new_tokens` after each prompt, batched; a row stops after its first
    EOS token (kept as its last token, as `model.generate` does) and soon leaves the batch.
    Sampling (temperature > 0) draws from torch's global generator. Returns each prompt's
    tokens.

    With `tails` (one per prompt, or None for a prompt whose states are not wanted) it returns
    (tokens, states): states[i], float16 (n, H), the base's final hidden states over prompt i,
    its reply (the tokens without a final EOS) and tails[i] (what the chat template puts
    after a reply, e.g. `<|im_end|>` and a newline), which are fed to the row once its reply
    ends and before it leaves the batch. These are what hidden-state caching computes for a
    sample of exactly those tokens (data_prep/hidden.py takes them instead of running the
    base again). Rows in their tail keep the batch larger for a step or two, so a sampled
    reply can differ from one generated without `tails` (greedy replies do not, up to float
    noise).
    """
    if max_new_tokens <= 0:
        return (
            [[] for _ in prompts]
            if tails is None
            else ([[] for _ in prompts], [None] * len(prompts))
        )
    device = model.device
    width = max(len(p) for p in prompts)
    capture = tails is not None
    extra = 1 + max((len(t) for t in tails if t is not None), default=0) if capture else 0
    cache, logits, kept = _prefill(model, prompts, pad, width + max_new_tokens + extra, capture)
    _, attn = _left_pad(prompts, pad, device)  # (B, L): 1 on real tokens
    pos = attn.sum(-1)  # (B,) position of each row's next token
    owner = torch.arange(len(prompts), device=device)  # batch row -> prompt index
    going = torch.ones(len(prompts), dtype=torch.bool, device=device)  # rows still generating
    eos_t = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    out_tokens: list[list[int]] = [[] for _ in prompts]
    # capture: per prompt, the tokens it still has to feed after its reply, and its states
    queue: list[list[int]] = [[] for _ in prompts]
    fed_states: list[list[torch.Tensor]] = [[] for _ in prompts]
    nxt = torch.full((len(prompts),), pad, dtype=torch.long, device=device)
    step = 0
    while True:
        if bool(going.any()):
            nxt = sample_rows(logits, temperature, top_p=top_p)  # (B,)
            stop = torch.isin(nxt, eos_t)
            if step == max_new_tokens - 1:
                stop[:] = True
            rows = zip(owner.tolist(), nxt.tolist(), going.tolist(), stop.tolist(), strict=True)
            for r, t, g, s in rows:
                if g:
                    out_tokens[r].append(t)
                    if s and capture and tails[r] is not None:  # its last token, unless EOS
                        queue[r] = ([] if t in eos else [t]) + tails[r]
            going &= ~stop
        fed, active = nxt.clone(), going.clone()  # what each row feeds, and whether it counts
        if capture:
            for b, r in enumerate(owner.tolist()):
                if queue[r]:
                    fed[b] = queue[r].pop(0)
                    active[b] = True
        alive = int(active.sum())
        if alive == 0:
            break
        # Finished rows leave in whole steps of ROW_STEP rows: a matmul over 13 rows costs
        # more than over 16 here, so the rest of a step's rows keep generating as ballast.
        target = -(-alive // ROW_STEP) * ROW_STEP
        if target < len(owner):
            keep = torch.cat([active.nonzero()[:, 0], (~active).nonzero()[:, 0]])[:target]
            keep = keep.sort().values
            owner, going, active, fed, pos, attn = (
                x[keep] for x in (owner, going, active, fed, pos, attn)
            )
            # columns that are padding in every remaining row: the longest prompt may be gone
            lead = int((attn.shape[1] - attn.sum(-1)).min())
            attn = attn[:, lead:]
            cache.select_rows(keep)
            cache.trim(lead)
        attn = torch.cat([attn, attn.new_ones(len(owner), 1)], dim=1)
        logits, h = _forward(model, fed[:, None], attn, pos[:, None], cache, capture)
        nxt = fed
        if capture:
            h = h[:, 0].float().cpu()
            for b, (r, a) in enumerate(zip(owner.tolist(), active.tolist(), strict=True)):
                if a and tails[r] is not None:
                    fed_states[r].append(h[b].clone())  # a view would keep the step's rows
        pos = pos + 1
        step += 1
    if not capture:
        return out_tokens
    states: list[np.ndarray | None] = []
    for i in range(len(prompts)):
        if tails[i] is None:
            states.append(None)
            continue
        rows = [kept[i], torch.stack(fed_states[i])] if fed_states[i] else [kept[i]]
        states.append(torch.cat(rows).numpy().astype(np.float16))
    return out_tokens, states
