"""Per-device memory plan of a training config: what each GPU (or the CPU) holds at peak.

Counted per device, in bytes, for the configured strategy, world size, precision, batch and
length: the frozen base's weights (replicated, or sharded by ZeRO-3 / FSDP, plus the layer being
gathered), the heads' parameters, gradients and AdamW states (sharded as each ZeRO stage does),
the base forward's transient activations, what the heads keep for their backward, and the
chunked loss (one chunk of head and teacher logits, plus the closed-form gradients it keeps).
Parameter counts are exact: the heads are built on PyTorch's meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from train.core.errors import ConfigError
from train.heads.config import RECURRENT, UNROLLED

GPUS_GB = {"a100_40gb": 40, "a100_80gb": 80, "h100_80gb": 80, "h200": 141, "l40s": 48, "a10g": 24}
GIB = 1024**3
ARCH_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)
MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass
class Setup:
    """What the plan needs to know about the job."""

    world: int
    strategy: str  # single | ddp | fsdp | zero2 | zero3 | zero3_offload
    device: str  # gpu | cpu
    act_bytes: int  # bytes per activation element (2 under bf16/fp16 autocast, else 4)
    base_bytes: int  # bytes per base weight


def strategy_of(trainer: dict) -> str:
    strat = trainer.get("strategy")
    target = str((strat or {}).get("_target_", "")) if isinstance(strat, dict) else str(strat or "")
    if "DeepSpeed" in target or "deepspeed" in target:
        import json
        from pathlib import Path

        cfg = strat.get("config") if isinstance(strat, dict) else None
        zero = {}
        if isinstance(cfg, str) and Path(cfg).is_file():
            zero = json.loads(Path(cfg).read_text()).get("zero_optimization", {})
        elif isinstance(cfg, dict):
            zero = cfg.get("zero_optimization", {})
        if int(zero.get("stage", 2)) == 3:
            return "zero3_offload" if zero.get("offload_param") else "zero3"
        return "zero2"
    if "FSDP" in target or "fsdp" in target:
        return "fsdp"
    if "DDP" in target or "ddp" in target:
        return "ddp"
    return "single"


def setup_of(trainer: dict, base_dtype: str) -> Setup:
    devices = trainer.get("devices", 1)
    devices = devices if isinstance(devices, int) else 1
    world = devices * int(trainer.get("num_nodes", 1) or 1)
    device = "cpu" if trainer.get("accelerator") == "cpu" else "gpu"
    precision = str(trainer.get("precision", "32-true"))
    # auto is bf16-mixed on the GPUs a plan sizes; on a CPU it depends on its units: the larger
    half = precision.startswith(("bf16", "16")) or (precision == "auto" and device == "gpu")
    return Setup(
        world=world,
        strategy=strategy_of(trainer) if world > 1 else "single",
        device=device,
        act_bytes=2 if half else 4,
        base_bytes=4 if base_dtype == "float32" else 2,  # bfloat16 / float16 / auto
    )


def experts(arch: dict) -> tuple[int, int, int]:
    """(experts per layer, experts active per token, one expert's intermediate size); (0, 0,
    intermediate_size) for a dense MLP. Mixtral names them num_local_experts, Qwen-MoE
    num_experts with moe_intermediate_size."""
    E = arch.get("num_experts") or arch.get("num_local_experts") or 0
    if not E:
        return 0, 0, arch["intermediate_size"]
    return (
        E,
        arch.get("num_experts_per_tok") or 1,
        arch.get("moe_intermediate_size") or (arch["intermediate_size"]),
    )


def base_params(arch: dict) -> tuple[int, int]:
    """(all base parameters, one decoder layer's) for a Llama-style architecture: attention
    (grouped-query, any head_dim), a gated MLP or E gated experts with their router, 2 norms."""
    H, L = arch["hidden_size"], arch["num_hidden_layers"]
    nh = arch["num_attention_heads"]
    nkv = arch.get("num_key_value_heads") or nh
    hd = arch.get("head_dim") or H // nh
    V = arch["vocab_size"]
    E, _, inter = experts(arch)
    mlp = E * (3 * H * inter) + H * E if E else 3 * H * inter
    layer = H * nh * hd * 2 + H * nkv * hd * 2 + mlp + 2 * H
    embed = V * H * (1 if arch.get("tie_word_embeddings") else 2)
    return embed + L * layer + H, layer


def head_params(head_cfg, arch: dict) -> tuple[int, int]:
    """Exact parameter counts of the head set, trainable and frozen (the base's lm_head rows
    of zankner/Hydra's recurrent heads, or every head's under head.freeze_lm_heads), built on
    the meta device."""
    from train.heads import build_heads

    shape = {k: v for k, v in arch.items() if v is not None}
    V, H = arch["vocab_size"], arch["hidden_size"]
    draft = torch.arange(min(head_cfg.draft_vocab_size, V)) if head_cfg.draft_vocab_size else None
    with torch.device("meta"):
        heads = build_heads(head_cfg, shape, torch.empty(V, H), draft)
    params = list(heads.parameters())  # a shared module's parameters once
    trained = sum(p.numel() for p in params if p.requires_grad)
    return trained, sum(p.numel() for p in params) - trained


def estimate(cfg, arch: dict, assistant_fraction: float = 0.75) -> dict[str, Any]:
    """Bytes per device by component for TrainConfig `cfg` and base architecture `arch`."""
    st = setup_of(cfg.trainer, cfg.base.dtype)
    W, a = st.world, st.act_bytes
    H, inter, V = arch["hidden_size"], arch["intermediate_size"], arch["vocab_size"]
    nh = arch["num_attention_heads"]
    K = cfg.head.num_heads
    B = cfg.data.batch_size
    T = cfg.data.max_length or arch.get("max_length") or 2048
    P_base, P_layer = base_params(arch)
    P_heads, P_frozen = head_params(cfg.head, arch)
    V_out = min(cfg.head.draft_vocab_size or V, V)
    sharded = st.strategy in ("zero3", "zero3_offload", "fsdp")

    rows: dict[str, float] = {}
    # frozen base weights
    if cfg.data.offline:
        rows["base weights (offline: lm_head + embeddings)"] = 2 * V * H * st.base_bytes
    elif st.strategy == "zero3_offload":
        rows["base weights (offloaded; gathered layer)"] = 2 * P_layer * st.base_bytes
    elif sharded:
        rows["base weights (1/world + gathered layer)"] = (P_base / W + 2 * P_layer) * st.base_bytes
    else:
        rows["base weights"] = P_base * st.base_bytes
    # heads: fp32 master weights, grads, AdamW (2 states)
    p, g, o = 4 * P_heads, 4 * P_heads, 8 * P_heads
    if st.strategy == "zero2":
        g, o = g / W, o / W
    elif sharded:
        # + what is gathered whole during a step: the output projections (read by the loss for
        # the whole step) and the largest head module at a time
        # (frozen lm heads are in their own row below, not in P_heads)
        lm = 0 if P_frozen else (V_out * H if cfg.head.name in UNROLLED else K * V_out * H)
        working = 4 * (lm + (P_heads - lm) / K)
        p, g, o = p / W + working, g / W, o / W
    elif st.strategy == "ddp":
        g *= 2  # gradient buckets
    rows.update({"heads weights": p, "heads grads": g, "heads AdamW states": o})
    # frozen lm heads (no grads, no AdamW): zankner/Hydra's recurrent heads' (the base's rows;
    # EAGLE-3's is its own, trained, in P_heads), or every head's under head.freeze_lm_heads
    if P_frozen:
        rows["heads frozen lm heads"] = P_frozen * 4
    # base forward (no grad, validation's cut too): one layer's transients + the states kept
    BT, Bv, Tv = B * T, cfg.data.val_batch_size or B, cfg.data.val_max_length or T
    BTv, BTTv = max(BT, Bv * Tv), max(BT * T, Bv * Tv * Tv)  # training or validation, the larger
    E, active, expert_inter = experts(arch)
    mlp_act = 3 * active * expert_inter if E else 3 * inter  # the experts a token is routed to
    rows["base forward activations"] = 0 if cfg.data.offline else BTv * (5 * H + mlp_act) * a
    if st.device == "cpu" and not cfg.data.offline:
        rows["base attention scores (CPU math kernel)"] = nh * BTTv * 4
    layers = cfg.head.hidden_state_offset or cfg.head.name in UNROLLED  # every layer's output
    kept = 2 + (arch["num_hidden_layers"] + 1 if layers else 0)
    rows["base hidden states kept"] = BTv * H * a * kept
    # heads: inputs (context + path embeddings) and per-block saved tensors, per head
    uses_path = cfg.head.name != "medusa"
    in_dims = sum((k + 2) * H if uses_path else H for k in range(K))
    heads_act = BT * (in_dims * 2 + K * cfg.head.num_layers * 3 * H)
    if cfg.head.name in ("hydra_pp", *RECURRENT):
        steps = K if cfg.head.name in UNROLLED else 1  # EAGLE-3: the layer per unrolled step
        heads_act += steps * BT * (8 * H + 3 * inter)  # the extra decoder layer's saved tensors
    rows["heads activations"] = heads_act * a
    # loss: valid positions gathered per head, one logits chunk (head + teacher), and the
    # closed-form gradients kept for backward (dL/dstate and dL/dW per head)
    n = BT * assistant_fraction
    chunk = cfg.head.loss.chunk_size
    lm_grads = 0 if P_frozen else V_out * H  # a frozen lm head has no dL/dW
    rows["loss: gathered states + saved grads"] = K * (2 * n * H + lm_grads) * 4
    # head and teacher logits of one chunk (the teacher restricted to the draft vocab too),
    # softmax/grad temporaries, and the chunked argmax of the base over its own vocab
    live = min(chunk, n)
    rows["loss: one chunk of logits"] = live * V_out * 4 * 4 + min(1024, BT) * V * 4
    return {
        "setup": st.__dict__,
        "params": {"base": P_base, "heads": P_heads, "heads_frozen": P_frozen},
        "batch": {"batch_size": B, "max_length": T},
        "rows": rows,
        "total": sum(rows.values()),
        # GPU: CUDA context + allocator slack. CPU: what a Lightning fit adds beyond tensors
        # (trainer, data loading, allocator arenas), ~200 MB measured on SmolLM2 and tiny runs.
        "runtime_overhead": 1.0 * GIB if st.device == "gpu" else 192 * 2**20,
    }


def verdict(cfg, arch: dict, gpu_gb: float) -> dict[str, Any]:
    """Fits or not on a GPU of `gpu_gb`, and if not the smallest change that fits."""
    from copy import deepcopy

    est = estimate(cfg, arch)
    need = est["total"] + est["runtime_overhead"]
    res = {"need_gb": need / GIB, "gpu_gb": gpu_gb, "fits": need <= gpu_gb * GIB * 0.95}
    if res["fits"]:
        return res
    tries = []
    c = deepcopy(cfg)
    while c.data.batch_size > 1:  # smaller micro-batches, same global batch
        c.data.batch_size //= 2
        acc = c.trainer.get("accumulate_grad_batches", 1) * 2
        c.trainer["accumulate_grad_batches"] = acc
        label = f"data.batch_size={c.data.batch_size} trainer.accumulate_grad_batches={acc}"
        tries.append((label, deepcopy(c)))
    for offload in (False, True):
        c = deepcopy(cfg)
        c.trainer["strategy"] = _zero3(offload)
        tries.append(("trainer=deepspeed_zero3" + ("_offload" if offload else ""), c))
    for nodes in (2, 4, 8, 16):
        c = deepcopy(cfg)
        c.trainer["strategy"] = _zero3(False)
        c.trainer["num_nodes"] = int(c.trainer.get("num_nodes", 1) or 1) * nodes
        tries.append((f"trainer=deepspeed_zero3 trainer.num_nodes={c.trainer['num_nodes']}", c))
    for label, c in tries:
        e = estimate(c, arch)
        if e["total"] + e["runtime_overhead"] <= gpu_gb * GIB * 0.95:
            res["suggestion"] = label
            res["suggestion_gb"] = (e["total"] + e["runtime_overhead"]) / GIB
            break
    return res


def _zero3(offload: bool) -> dict:
    zero: dict[str, Any] = {"stage": 3}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    return {"_target_": "deepspeed", "config": {"zero_optimization": zero}}


def base_arch(base) -> dict[str, Any]:
    """The architecture numbers of the base, without loading its weights: `base.arch` when the
    config gives it, else the model's own config (local dir, HF cache or the GGUF's cached copy)."""
    if base.arch:
        # tie_word_embeddings may be left out (false), num_key_value_heads too (= the heads), and
        # an MoE's intermediate_size where it gives moe_intermediate_size
        optional = {"tie_word_embeddings", "num_key_value_heads"}
        if base.arch.get("moe_intermediate_size"):
            optional.add("intermediate_size")
        need = [k for k in ARCH_KEYS if k not in optional]
        missing = [k for k in need if base.arch.get(k) is None]
        if missing:
            raise ConfigError(
                f"base.arch of base={base.name} lacks {', '.join(missing)}: give every one of "
                f"{', '.join(need)} (the model's config.json has them), or remove base.arch to "
                "read them from the model's own config"
            )
        return dict(base.arch)
    if base.source == "tiny_random":
        from train.core.base import tiny_tokenizer

        vocab = max(base.tiny.vocab_size or 0, len(tiny_tokenizer()))
        return {k: vocab if k == "vocab_size" else getattr(base.tiny, k) for k in ARCH_KEYS}
    from transformers import AutoConfig

    from train.core.base import BaseLoadError, ensure_gguf_cache, resolve_gguf, resolve_pretrained

    if base.source in ("gguf_package", "gguf_file"):
        config = AutoConfig.from_pretrained(str(ensure_gguf_cache(resolve_gguf(base))))
    else:
        try:
            config = AutoConfig.from_pretrained(resolve_pretrained(base))
        except (OSError, BaseLoadError) as e:
            raise BaseLoadError(
                f"cannot read the architecture of base {base.name}: {str(e).rstrip('.')}. Set "
                "base.arch (hidden_size, num_hidden_layers, intermediate_size, "
                "num_attention_heads, num_key_value_heads, vocab_size, tie_word_embeddings) to "
                "plan without the model"
            ) from None
    keys = (*ARCH_KEYS, *MOE_KEYS, "head_dim", "rope_theta", "rms_norm_eps")
    return {k: getattr(config, k, None) for k in (*keys, "max_position_embeddings")}


def rss_bytes() -> int:
    """Resident memory of this process (Linux /proc)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's resident memory every few ms in a thread: `with PeakRSS() as m:`
    ... then m.peak - m.start is what the block added at its peak."""

    def __init__(self, every_s: float = 0.005):
        self.every_s = every_s

    def __enter__(self):
        import threading

        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()

        def loop():
            while not self._stop.is_set():
                self.peak = max(self.peak, rss_bytes())
                self._stop.wait(self.every_s)

        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())
        return False
