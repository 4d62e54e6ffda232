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
- Weight layout (`eval.weight_layout`): torch multiplies a float32 CPU linear layer with
  MKL, whose products of a few rows (a plain step, a verify pass of 2-64 tokens) are slow on
  some CPUs and erratic in the row count: on a 2-core AMD EPYC, SmolLM2's linears took 46 ms
  for 1 row, 76 for 2 and 96 for 3 (MKL's own prepacked API: 42 and 59). `use_weight_layout`
  gives each float32 linear layer a copy of its weight
  prepacked once in oneDNN's blocked layout (`torch.ops.mkldnn`, the kernels inductor's
  frozen graphs call): there the same linears took 27 ms for 1 row, 27 for 2, 37 for 8 and
  51 for 16. With `auto` (the default) each weight shape is timed in both ways at 1-64 rows
  at start-up (alternately, best of several) and each row count takes the packed copy where
  it is at least 3% faster (near a tie torch's own: fewer flips from run to run);
  `packed` takes the copy at every count.
  The copy is one more set of the weights in memory. A bf16 linear gets a bf16 copy the same
  way: torch's bf16 CPU matmul hands oneDNN the plain weight, reordered at every call (on a
  2-core Sapphire Rapids SmolLM2's linears took 35 ms a step, 25 packed). Both compute the
  same product; a different kernel may round its last bit differently, as a different batch
  size does.
- Compile: `compile_body` compiles the base's body (inductor with frozen weights on CPU, CUDA
  graphs on CUDA); the decoder keeps one graph per verify size and capacity bucket.
- `forward`: the base over new tokens at given positions, appending to a cache.
"""

from __future__ import annotations

import copy
import functools
import inspect
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from train.core.errors import UserError
from train.core.hardware import cpu_has_bf16

ATTENTION = "hydra_sdpa_gqa"
BASE_QUANT = ("none", "bf16", "int8")
WEIGHT_LAYOUT = ("auto", "standard", "packed")
# rows timed per weight shape (a verify pass of up to 64 tokens); a count in between takes the
# layout of the next one timed, a count past the last the last one's
PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


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
    """Switch a transformers model (and its sub-configs) to `sdpa_gqa`. A model whose
    attention soft-caps its scores (Gemma-2's `attn_logit_softcapping`), which SDPA cannot do,
    keeps its own attention function."""
    _register()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            continue
        if cfg is not None and getattr(cfg, "_attn_implementation", None) in ("sdpa", "eager"):
            cfg._attn_implementation = ATTENTION


def output_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The base's next-token logits from its final hidden states, as its own forward computes
    them: `lm_head` (looked up at each call: `use_weight_layout` may replace it after a
    decoder is built), then `final_logit_softcapping` where the config has it (Gemma-2/3:
    cap * tanh(logits / cap), which keeps the argmax but not the sampling distribution)."""
    logits = model.lm_head(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


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


PACKABLE = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can hold `weight` prepacked: a float32 or bf16 CPU weight in a torch
    built with oneDNN (every x86 and arm64 CPU build)."""
    return (
        weight.dtype in PACKABLE
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear(nn.Module):
    """A float32 or bf16 CPU linear layer that also holds its weight prepacked in oneDNN's
    blocked layout, and multiplies `take`'s row counts with it (oneDNN's matmul on the packed
    copy) and the others with torch's own (MKL, or for bf16 oneDNN on the unpacked weight,
    reordered at every call). take[n] is the choice for n rows;
    counts past the list take its last entry. The original weight and bias are the layer's
    own tensors (tied weights stay tied); the packed copy (given, or made here) is an
    opaque oneDNN tensor kept as a plain attribute, outside state_dict and `.to()` (a layer
    cast to another dtype or moved off the CPU, or one run under autocast, uses its original
    weight), and a deep copy packs the copied weight anew."""

    def __init__(
        self, linear: nn.Linear, take: tuple[bool, ...], packed: torch.Tensor | None = None
    ):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.take = take
        self.packed = pack(linear.weight) if packed is None else packed
        self.packed_dtype = linear.weight.dtype  # a cast layer's copy is stale: not used

    def __deepcopy__(self, memo) -> PackedLinear:
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None, "meta")
        lin.weight = copy.deepcopy(self.weight, memo)
        lin.bias = copy.deepcopy(self.bias, memo)
        return PackedLinear(lin, self.take)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // self.in_features
        if (
            n
            and self.take[min(n, len(self.take) - 1)]
            and x.dtype == self.weight.dtype == self.packed_dtype
            and x.device.type == "cpu"
            and not torch.is_autocast_enabled("cpu")  # autocast casts in torch's matmul
        ):
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in) prepacked for oneDNN's matmul (no row-count hint: one copy for all)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None):
    """x @ W.T + bias with W prepacked by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def race(a, b, reps: int, clock=time.perf_counter) -> tuple[float, float]:
    """Best-of-`reps` seconds of the calls `a` and `b`, after one warm-up call of each, timed
    alternately (a b, then b a, ...): a drift in the machine's speed while they are timed (another
    process, the clock, the cache a previous call left) touches both alike, where timing all of
    `a` and then all of `b` let it decide which looked faster."""
    a(), b()
    best = [float("inf"), float("inf")]
    for rep in range(reps):
        order = ((0, a), (1, b)) if rep % 2 == 0 else ((1, b), (0, a))
        for i, fn in order:
            t = clock()
            fn()
            best[i] = min(best[i], clock() - t)
    return best[0], best[1]


# A row count takes the packed copy only where it is at least this much faster: near a tie the
# timing's noise alone decides. This narrows the run-to-run variation without removing it (on
# the 2-core Xeon, four start-ups chose 1-2,4+ / 3+ / 3+ / 4+ for the output projection
# before, 3+ / 4+ / 3+ / 2+ after: a 113 MB weight times noisily); tree=auto's own interleaved
# timing is what keeps its choice steady.
PACK_MARGIN = 0.03


def packed_rows(weights: list[torch.Tensor], packed: list[torch.Tensor]) -> tuple[bool, ...]:
    """PackedLinear's `take` for weights of one shape on this machine: for each row count
    0..PROBE_ROWS[-1], whether the packed copies multiply it faster (by PACK_MARGIN) than
    torch's own matmul (each count takes the choice timed at the next count of PROBE_ROWS;
    counts past the last take its choice). Each timing runs over all of `weights`, as a forward
    streams them from memory: one weight timed alone stays in the CPU's cache, where MKL looked
    faster at 1 row than it is in a model (on the 2-core EPYC, SmolLM2's 576 x 576 weight alone
    favoured MKL at 1-2 rows; its 30 layers' linears took 46 ms with MKL, 27 packed)."""
    reps = 3 if sum(w.numel() for w in weights) > 4_000_000 else 5  # a ~10 ms call: 3 reps
    faster = {}
    with torch.no_grad():
        for n in PROBE_ROWS:
            x = torch.randn(n, weights[0].shape[1], dtype=weights[0].dtype)
            standard, onednn = race(
                lambda x=x: [F.linear(x, w) for w in weights],
                lambda x=x: [packed_linear(x, p) for p in packed],
                reps,
            )
            faster[n] = onednn < standard * (1 - PACK_MARGIN)
    return (False,) + tuple(
        faster[next(p for p in PROBE_ROWS if p >= n)] for n in range(1, PROBE_ROWS[-1] + 1)
    )


def _spans(take: tuple[bool, ...]) -> str:
    """(False, True, True, False, True) -> '1-2,4+' (the last count stands for all above it)."""
    rows = [n for n, t in enumerate(take) if t]
    out, run = [], []
    for n in rows:
        if run and n != run[-1] + 1:
            out.append(run)
            run = []
        run.append(n)
    out.append(run)
    last = len(take) - 1
    return ",".join(
        f"{r[0]}+" if r[-1] == last else f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0])
        for r in out
        if r
    )


def use_weight_layout(
    *models: nn.Module | None, layout: str = "auto", key: str = "eval.weight_layout"
) -> dict[str, str]:
    """Give the float32 and bf16 CPU linear layers of `models` (a base, its heads)
    oneDNN-packed weights (see the module docstring): at every row count with layout=packed,
    at the counts where timing on this machine says the packed copy is faster with
    layout=auto (each weight shape and dtype timed once). Returns {"<out>x<in>": those row
    counts as spans like '1-12' or '2+'} for the shapes that got one ("<out>x<in> bf16" for
    bf16 weights). `key`: the setting that chose `layout`, named in errors."""
    if layout not in WEIGHT_LAYOUT:
        raise BackendError(f"{key}={layout!r} is invalid: choose one of {', '.join(WEIGHT_LAYOUT)}")
    if layout == "standard":
        return {}
    linears = [
        (parent, name, child)
        for model in models
        if model is not None
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and can_pack(child.weight)
    ]
    # distinct weights per (shape, dtype): the unit that is timed
    groups: dict[tuple[int, int, torch.dtype], dict[int, torch.Tensor]] = {}
    for _, _, lin in linears:
        groups.setdefault(_group(lin.weight), {})[id(lin.weight)] = lin.weight
    # Each (shape, dtype) is packed on its own: a dtype this CPU's oneDNN cannot reorder (bf16
    # without AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AMD EPYC with AVX2 only) keeps torch's own
    # matmul, and the other groups (a bf16 base's float32 heads) still get their copies.
    packed: dict[int, torch.Tensor] = {}
    for g in list(groups):
        try:
            packed.update({k: pack(w) for k, w in groups[g].items()})
        except RuntimeError as e:  # a torch build whose oneDNN cannot reorder for this CPU
            if layout == "packed":
                raise BackendError(
                    f"{key}=packed: this torch cannot prepack the {_shape_name(g)} weights "
                    f"for oneDNN on this CPU ({e}); use {key}=auto or standard"
                ) from e
            del groups[g]
    every = (False,) + (True,) * PROBE_ROWS[-1]
    # bf16 on a CPU with bf16 units: packed at every count, untimed. torch's own bf16 matmul is
    # the same oneDNN kernel after a reorder of the weight at every call, so it is never
    # faster, and a noisy start-up timing once sent a 49k x 576 projection's 9-48 rows to it
    # (4.7 ms a call against 1.3); without the units either may win, and timing decides.
    chosen = {
        g: every
        if layout == "packed" or (g[2] == torch.bfloat16 and cpu_has_bf16())
        else packed_rows(list(ws.values()), [packed[k] for k in ws])
        for g, ws in groups.items()
    }
    for parent, name, lin in linears:
        take = chosen.get(_group(lin.weight), ())
        if any(take):
            setattr(parent, name, PackedLinear(lin, take, packed[id(lin.weight)]))
    return {_shape_name(g): _spans(t) for g, t in chosen.items() if any(t)}


def _shape_name(group: tuple[int, int, torch.dtype]) -> str:
    """(576, 1536, float32) -> '576x1536'; a bf16 weight's gets ' bfloat16' added."""
    o, i, dt = group
    return f"{o}x{i}" if dt == torch.float32 else f"{o}x{i} {str(dt).removeprefix('torch.')}"


def _group(weight: torch.Tensor) -> tuple[int, int, torch.dtype]:
    return (*weight.shape, weight.dtype)


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


def head_features(out, features: int | tuple[int, ...] = 0) -> torch.Tensor:
    """What the heads read from a base forward's output `out` (run with
    `output_hidden_states=wants_layers(features)`): `features` 0, the final (post-norm)
    hidden states; n > 0, the output of the n-th layer from the end; a tuple, the hidden states
    at those indices of `out.hidden_states` (0: the embeddings, i: the input of layer i),
    concatenated (EAGLE-3's low, middle and high layers)."""
    if isinstance(features, tuple):
        return torch.cat([out.hidden_states[i] for i in features], dim=-1)
    return out.last_hidden_state if features == 0 else out.hidden_states[-1 - features]


def wants_layers(features: int | tuple[int, ...]) -> bool:
    """Whether `head_features` reads per-layer hidden states (output_hidden_states=True)."""
    return isinstance(features, tuple) or features > 0


@torch.no_grad()
def forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache,
    mask: torch.Tensor | None = None,
    features: int | tuple[int, ...] = 0,
    body=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The base's body over `input_ids` (B, n) at `positions` (B, n), appending to `cache`,
    under the additive `mask` (B, 1, n, cached + n), or causal attention when None.

    Returns the final (post-norm) hidden states (B, n, H), which the base's lm_head turns into
    logits, and what the heads read (`head_features`: the same tensor, another layer's output,
    or several layers' concatenated).
    `body`: what runs in place of `model.model` (its compiled version).
    """
    out = (body if body is not None else model.model)(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        output_hidden_states=wants_layers(features),
        **{cache_kwarg(type(model.model)): cache},
    )
    return out.last_hidden_state, head_features(out, features)
