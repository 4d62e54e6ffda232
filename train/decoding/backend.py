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
- Compile: `compile_body` compiles the base's body (inductor with frozen weights on CPU, CUDA
  graphs on CUDA); the decoder keeps one graph per verify size and capacity bucket.
- `forward`: the base over new tokens at given positions, appending to a cache.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from train.core.errors import UserError

ATTENTION = "hydra_sdpa_gqa"
BASE_QUANT = ("none", "bf16", "int8")


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
