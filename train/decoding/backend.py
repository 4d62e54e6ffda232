"""How the base model runs at decode time: its attention kernel, its weights' precision
(`eval.base_quant`), and `torch.compile` of its forward (`eval.compile`).

- Attention: transformers' sdpa path repeats the grouped KV heads into a full-size copy
  whenever a mask is passed, which a tree verify forward always does (SmolLM2: 3 KV heads ->
  9, a copy of the whole prefix per layer per step; on 2 CPU cores a quarter of a 16-token
  verify). `sdpa_gqa` hands the grouped heads to torch's SDPA with `enable_gqa=True` instead.
- Precision: `bf16` casts the base's weights (AVX512-BF16 / AMX CPUs and every GPU run a
  bf16 matmul of a few rows at the cost of one); `int8` is torch's dynamic int8 quantization
  of the linear layers on CPU (weights int8, activations quantized per call). Speculative and
  plain decoding share the one quantized base, so "lossless" means identical to plain greedy
  decoding of that base. The heads run in the base's compute dtype (bf16 on a bf16 base,
  float32 on an int8 one).
- Weight layout (`eval.weight_layout`): a float32 CPU matmul of a few rows (a verify pass of
  4-15 tokens) is slow in the layout torch stores linear weights in, (out, in): on this
  project's 2-core Xeon, SmolLM2's 576 -> 1536 projection of 8 rows took 3x its time at 1
  row, while a 16-row one took less than the 8-row one. The same product with a transposed
  copy of the weights, (in, out), grows smoothly with the rows. `use_dual_layout` times both
  layouts per weight shape and row count on this machine and gives each linear layer the
  transposed copy where it is faster, kept beside the original (one more copy of the weights
  in memory). It is opt-in (`eval.weight_layout=auto`): on one thread it cut a 12-token verify
  from 117 to 84 ms, but on two threads bench_decode.py's verify costs with and without it
  were within their noise at 2-32 tokens. Both layouts compute the same product; a different
  kernel may round its last bit differently, as a different batch size does.
- Compile: `compile_body` compiles the base's body (inductor with frozen weights on CPU, CUDA
  graphs on CUDA); the decoder keeps one graph per verify size and capacity bucket.
- `forward`: the base over new tokens at given positions, appending to a cache.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from train.core.errors import UserError

ATTENTION = "hydra_sdpa_gqa"
BASE_QUANT = ("none", "bf16", "int8")
WEIGHT_LAYOUT = ("auto", "standard")
# rows timed per weight shape (a verify pass of up to 32 tokens); a count in between takes the
# layout of the next one timed
PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


class BackendError(UserError, ValueError):
    """A decode backend setting this machine or model cannot use."""


def sdpa_gqa(
    module: nn.Module,
    query: torch.Tensor,  # (B, Hq, n, D)
    key: torch.Tensor,  # (B, Hkv, S, D)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over torch SDPA, grouped KV heads kept as
    they are. Without a mask, n > 1 queries are causal over themselves (transformers builds a
    mask whenever there is a cached prefix) and a single query sees everything."""
    mask = attention_mask
    if mask is not None:
        mask = mask[:, :, :, : key.shape[-2]]
        if mask.dtype != torch.bool and mask.dtype != query.dtype:
            mask = mask.to(query.dtype)
    causal = mask is None and query.shape[2] > 1 and (is_causal is None or is_causal)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=causal,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, sdpa_gqa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def use_gqa_attention(model: nn.Module) -> None:
    """Switch a transformers model (and its sub-configs) to `sdpa_gqa`."""
    _register()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) in ("sdpa", "eager"):
            cfg._attn_implementation = ATTENTION


def quantize_base(model: nn.Module, quant: str) -> nn.Module:
    """The base with `quant` weights (see the module docstring); returns the model to use."""
    if quant not in BASE_QUANT:
        raise BackendError(f"eval.base_quant={quant!r} is invalid: choose one of {BASE_QUANT}")
    if quant == "none":
        return model
    device = next(model.parameters()).device
    if quant == "bf16":
        return model.to(torch.bfloat16)
    if device.type != "cpu":
        raise BackendError(
            "eval.base_quant=int8 is torch's dynamic int8 quantization, which runs on CPU only: "
            "use eval.base_quant=bf16 on a GPU"
        )
    with warnings.catch_warnings():  # torch.ao's deprecation notice, once per linear layer
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


class DualLinear(nn.Module):
    """A float32 linear layer with its weight in both layouts: the original (out, in), and a
    transposed (in, out) copy for the row counts in `rows` (a call past the largest timed
    count, PROBE_ROWS[-1], takes the original: one 64-token verify took 188 ms with the copies
    past 32 rows, 112 ms without)."""

    def __init__(self, linear: nn.Linear, rows: frozenset[int]):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias  # shared (tied weights stay tied)
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous(), persistent=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.take = [n in rows for n in range(PROBE_ROWS[-1] + 1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // self.in_features
        if n >= len(self.take) or not self.take[n]:
            return F.linear(x, self.weight, self.bias)
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def _best_of(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def transposed_rows(weight: torch.Tensor, margin: float = 0.9) -> frozenset[int]:
    """The row counts (1..32) at which the transposed layout is faster than the original on
    this machine (under `margin` of its time): each count takes the choice timed at the next
    count of PROBE_ROWS."""
    w, wt = weight.detach(), weight.detach().t().contiguous()
    reps = 3 if w.numel() > 4_000_000 else 7  # an output projection: each call is ~10 ms
    faster = {}
    with torch.no_grad():
        for n in PROBE_ROWS:
            x = torch.randn(n, w.shape[1], dtype=w.dtype)
            standard = _best_of(lambda x=x: F.linear(x, w), reps)
            faster[n] = _best_of(lambda x=x: x @ wt, reps) < margin * standard
    return frozenset(
        n for n in range(1, PROBE_ROWS[-1] + 1) if faster[next(p for p in PROBE_ROWS if p >= n)]
    )


def _spans(rows: frozenset[int]) -> str:
    """{1, 2, 3, 7, 8} -> '1-3,7-8'."""
    out, run = [], []
    for n in sorted(rows):
        if run and n != run[-1] + 1:
            out.append(run)
            run = []
        run.append(n)
    out.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out if r)


def use_dual_layout(model: nn.Module, layout: str = "auto") -> dict[str, str]:
    """With layout=auto, give each float32 CPU linear layer of `model` the transposed copy of
    its weight at the row counts where timing on this machine says it is faster (see the
    module docstring). Returns {"<out>x<in>": those row counts, as spans like '4-12'} for the
    shapes that got one."""
    if layout not in WEIGHT_LAYOUT:
        raise BackendError(
            f"eval.weight_layout={layout!r} is invalid: choose one of {', '.join(WEIGHT_LAYOUT)}"
        )
    if layout == "standard":
        return {}
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.dtype == torch.float32
        and child.weight.device.type == "cpu"
    ]
    chosen: dict[tuple[int, int], frozenset[int]] = {}  # timed once per weight shape
    for parent, name, lin in linears:
        shape = tuple(lin.weight.shape)
        if shape not in chosen:
            chosen[shape] = transposed_rows(lin.weight)
        rows = chosen[shape]
        if rows:
            setattr(parent, name, DualLinear(lin, rows))
    return {f"{o}x{i}": _spans(r) for (o, i), r in chosen.items() if r}


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the base's activations (float32 for an int8-quantized base)."""
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def compile_body(model: nn.Module):
    """torch.compile of the base's body (no output projection): inductor with frozen weights
    on CPU, CUDA graphs (mode=reduce-overhead) on CUDA."""
    import torch._dynamo.config as dynamo_config

    # a graph per (verify size, capacity bucket) and per compiled model: a multi-turn suite
    # with trees passes dynamo's default limit of 8, past which it falls back to eager
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 512)
    device = next(model.parameters()).device
    if device.type == "cpu":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # weights as constants: prepacked for oneDNN
        return torch.compile(model.model, dynamic=False)
    return torch.compile(model.model, dynamic=False, mode="reduce-overhead")


@functools.cache
def cache_kwarg(model_cls: type) -> str:
    """transformers 5 renames `past_key_values` to `cache`; use whichever this version takes."""
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache,
    mask: torch.Tensor | None = None,
    hidden_state_offset: int = 0,
    body=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The base's body over `input_ids` (B, n) at `positions` (B, n), appending to `cache`,
    under the additive `mask` (B, 1, n, cached + n), or causal attention when None.

    Returns the final (post-norm) hidden states (B, n, H), which the base's lm_head turns into
    logits, and the hidden states the heads read: the same tensor, or the output of the
    `hidden_state_offset`-th layer from the end when the heads were trained on that.
    `body`: what runs in place of `model.model` (its compiled version).
    """
    out = (body if body is not None else model.model)(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        output_hidden_states=hidden_state_offset > 0,
        **{cache_kwarg(type(model.model)): cache},
    )
    final = out.last_hidden_state
    ctx = final if hidden_state_offset == 0 else out.hidden_states[-1 - hidden_state_offset]
    return final, ctx
