"""The interface every head architecture implements: teacher-forced training and tree proposal."""

from __future__ import annotations

import torch
from torch import nn

from train.heads.blocks import DraftVocab, layer_config, mlp_stack, official_noise
from train.heads.config import HeadConfig


class HeadSet(nn.Module):
    """K draft heads over a frozen base model. Head k (1-based) predicts x_{t+k+1} at position t.

    Subclasses define `context` (what the heads read at each position: the base hidden state,
    or Hydra++'s extra decoder layer over it) and `head_input` (what head k sees: the context
    alone for Medusa, the context plus embeddings of the k tokens before its target for Hydra).
    """

    arch: str = ""
    uses_path: bool = False  # True when head k is conditioned on the tokens before its target
    # Where zankner/Hydra adds its training noise: to the base hidden state too (mlp heads), or
    # to the path embeddings only (prefix-mlp: the extra layer reads the clean hidden states);
    # eagle-attn: to the hidden state only
    noise_on_hidden: bool = True
    noise_on_path: bool = True
    # A recurrent head set (eagle-attn) is one draft layer: its context at position t reads the
    # next token's embedding too, and it drafts deeper on its own output states (`step`)
    # instead of with one head per depth.
    recurrent: bool = False
    unrolled: bool = False  # a recurrent set trained on its own states (EAGLE-3's steps)
    # One lm head scores every head (EAGLE-3's unrolled steps): lm_heads holds it K times.
    shared_lm_head: bool = False
    RECURRENT_DEPTH = 4  # a recurrent set's chain and dynamic trees: mc_sim_7b_63's depth

    def __init__(
        self,
        cfg: HeadConfig,
        hidden_size: int,
        vocab_size: int,
        lm_head_weight: torch.Tensor,
        draft_ids: torch.Tensor | None = None,
        base_shape: dict | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.base_shape = dict(base_shape or {})
        if tuple(lm_head_weight.shape) != (vocab_size, hidden_size):
            raise ValueError(
                f"lm_head weight has shape {tuple(lm_head_weight.shape)}, expected "
                f"({vocab_size}, {hidden_size}); under ZeRO-3 gather it before building heads"
            )
        self.draft = DraftVocab(draft_ids, vocab_size) if draft_ids is not None else None
        rows = (
            lm_head_weight.detach()
            if self.draft is None
            else lm_head_weight.detach()[self.draft.to_full]
        )
        self.lm_heads = nn.ModuleList()
        for _ in range(1 if self.shared_lm_head else cfg.num_heads):
            lin = nn.Linear(hidden_size, rows.shape[0], bias=cfg.bias)
            with torch.no_grad():  # the base's own lm_head (official init: its bias random)
                lin.weight.copy_(rows.to(lin.weight.dtype))
                if cfg.bias and cfg.init == "ours":
                    lin.bias.zero_()
            self.lm_heads.append(lin)
        if self.shared_lm_head:
            self.lm_heads = nn.ModuleList([self.lm_heads[0]] * cfg.num_heads)
        if cfg.freeze_lm_heads:  # an extra: the base's rows, never trained
            self.lm_heads.requires_grad_(False)
        self.lm_dropout = nn.Dropout(cfg.dropout)  # before each lm head, as zankner/Hydra's
        # Head k's residual MLP: its first block reads the context, plus the k+1 path
        # embeddings for heads that use the path ((k+2)H -> H).
        self.mlps = nn.ModuleList(
            mlp_stack(
                (k + 2) * hidden_size if self.uses_path else hidden_size,
                hidden_size,
                cfg.num_layers,
                cfg.dropout,
                cfg.bias,
                cfg.tie_blocks,
                cfg.init,
            )
            for k in range(cfg.num_heads)
        )

    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads

    @property
    def depth_limit(self) -> int | None:
        """The deepest tree the heads can draft: one depth per head (None: any depth)."""
        return None if self.recurrent else self.cfg.num_heads

    @property
    def draft_depth(self) -> int:
        """How deep a chain or a dynamic tree drafts by default."""
        return self.RECURRENT_DEPTH if self.recurrent else self.cfg.num_heads

    @property
    def features(self) -> int | tuple[int, ...]:
        """What the heads read from the base (train/decoding/backend.py `head_features`): the
        hidden_state_offset-th layer from the end (0: the final state), or several layers."""
        return self.cfg.hidden_state_offset

    @property
    def out_vocab_size(self) -> int:
        return self.draft.size if self.draft is not None else self.vocab_size

    # -- what subclasses define -------------------------------------------------------------
    def context(
        self, hidden: torch.Tensor, cache=None, positions=None, mask=None, next_emb=None
    ) -> torch.Tensor:
        """(B, T, H) base hidden states -> (B, T, H) head context. Causal in T. cache,
        positions and mask are for heads with a context layer of their own (Hydra++);
        next_emb (B, T, H), the embeddings of the tokens after each position, for recurrent
        heads."""
        return hidden

    def step(self, emb, parent, cache, positions, mask, anchor=None) -> torch.Tensor:
        """A recurrent head set's drafting step: nodes' token embeddings emb (B, P, H) and
        their parents' output states (B, P, H), queried at `positions` (B, P) under `mask`;
        each appends one key to `cache` (EagleAttnHeads, CrossAttnHeads)."""
        raise NotImplementedError(f"{self.arch} heads draft with one head per depth")

    def head_input(self, k: int, ctx: torch.Tensor, path: torch.Tensor | None) -> torch.Tensor:
        """Input of head k (0-based) from context (..., H) and path embeddings (..., k+1, H)."""
        raise NotImplementedError

    # -- training: teacher forcing over whole sequences -------------------------------------
    def forward(
        self,
        hidden: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        select: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[torch.Tensor]:
        """Head states (what the output projection reads), teacher-forced.

        hidden: (B, T, H) base hidden states; input_embeds: (B, T, H) base embeddings of the
        input tokens (needed when `uses_path`); lengths: (B,) unpadded lengths (the noise
        scale). Returns K tensors (B, T, H); entry k-1 at position t is head k's state for
        predicting x_{t+k+1}, built from tokens <= t+k only. With `select`, K pairs (b, t) of
        (N_k,) indices, entry k-1 is (N_k, H): head k at those positions only. The heads are
        position-wise, so training runs them where the loss scores them (assistant tokens)
        instead of over every position and padding. In training, noise (head.noise_alpha)
        and dropout go where zankner/Hydra puts them.
        """
        noise = None
        if self.training and self.cfg.noise_alpha > 0:  # one draw for h_t and the embeddings
            noise = official_noise(hidden, self.cfg.noise_alpha, lengths)
        emb = None
        if self.uses_path:
            if input_embeds is None:
                raise ValueError(f"{self.arch} heads need input_embeds")
            on_path = noise is not None and self.noise_on_path
            emb = input_embeds + noise if on_path else input_embeds
            B, _, H = emb.shape
            # e(x_{t+1+j}) for t + 1 + j >= T is zero: (B, T + K, H)
            emb = torch.cat([emb, emb.new_zeros(B, self.num_heads, H)], dim=1)
        T = hidden.shape[1]
        h = hidden + noise if noise is not None and self.noise_on_hidden else hidden
        # a recurrent set's context reads e(x_{t+1}) beside h_t
        ctx = self.context(h, next_emb=emb[:, 1 : T + 1]) if self.recurrent else self.context(h)
        out = []
        for k in range(self.num_heads):
            if select is None:
                c, path = ctx, None  # (B, T, H); path[:, t, j] = e(x_{t+1+j}): (B, T, k+1, H)
                if emb is not None:
                    path = emb.unfold(1, k + 1, 1)[:, 1 : T + 1].permute(0, 1, 3, 2)
            else:
                b, t = select[k]
                c, path = ctx[b, t], None  # (N, H); path (N, k+1, H)
                if emb is not None:
                    path = emb[b[:, None], t[:, None] + torch.arange(1, k + 2, device=t.device)]
            out.append(self.lm_dropout(self.head_input(k, c, path)))
        return out

    # -- checkpoints: tied blocks are one tensor under several names ------------------------
    def unique_state(self) -> dict[str, torch.Tensor]:
        """The state dict with each tensor once (the first of the names tied blocks share)."""
        seen: set[tuple] = set()
        out = {}
        for name, t in self.state_dict().items():
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if t.numel() == 0 or key not in seen:
                out[name] = t
            seen.add(key)
        return out

    def load_unique_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load what `unique_state` wrote (every tied name set from the one that was saved)."""
        own = self.state_dict()
        first: dict[tuple, str] = {}
        full = {}
        for name, t in own.items():
            alias = first.setdefault((t.data_ptr(), tuple(t.shape), tuple(t.stride())), name)
            src = name if name in state or t.numel() == 0 else alias
            if src in state:
                full[name] = state[src]
        unknown = sorted(set(state) - set(own))
        if unknown:  # names no parameter of these heads has: let load_state_dict name them
            full.update({k: state[k] for k in unknown})
        self.load_state_dict(full, strict=True)

    def logits(self, k: int, state: torch.Tensor) -> torch.Tensor:
        """Head k's logits over its output vocab (draft vocab when one is set)."""
        return self.lm_heads[k](state)


class RecurrentHeadSet(HeadSet):
    """One draft layer that drafts deeper on its own output states (zankner/Hydra's eagle-attn
    and cross-attn, EAGLE-3): no residual blocks and no dropout. zankner/Hydra's are one head
    scored by the base's own lm_head (its rows, frozen, no bias); an `unrolled` set (EAGLE-3)
    trains num_heads unrolled steps on its own states, all scored by one lm head of its own
    (trained). Subclasses build the layer and define `context` (which also reads the next
    token's embedding) and `step`."""

    uses_path = True  # the context reads the next token's embedding
    recurrent = True

    def __init__(self, cfg: HeadConfig, *args, **kwargs):
        """HeadSet's arguments; then `build` makes the layer from the base's attention shape."""
        one = cfg.num_heads == 1 or self.unrolled
        if not one or cfg.num_layers != 1 or cfg.dropout or cfg.bias:
            heads = "" if self.unrolled else "head.num_heads=1, "
            raise ValueError(
                f"head={cfg.name} is one layer drafting recurrently, with no dropout and no lm "
                f"head bias: set {heads}head.num_layers=1, head.dropout=0 and head.bias=false "
                f"(got {cfg.num_heads}, {cfg.num_layers}, {cfg.dropout}, {cfg.bias}); the tree's "
                "depth sets how far it drafts"
            )
        super().__init__(cfg, *args, **kwargs)
        self.mlps = nn.ModuleList()  # no residual blocks: the layer is the head
        if not self.unrolled:
            self.lm_heads[0].weight.requires_grad_(False)  # the base's own lm_head, frozen
        shape = {**self.base_shape, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}
        self.build(layer_config(shape))

    def build(self, config) -> None:
        """Make the draft layer for a one-layer Llama `config` with the base's shape (and its
        `rotary_emb`)."""
        raise NotImplementedError

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's RoPE cos/sin at `positions` ((T,) or (B, T)) for x (B, T, ...)."""
        B, T = x.shape[:2]
        pos = positions if positions.dim() == 2 else positions[None].expand(B, T)
        return self.rotary_emb(x, pos)

    def head_input(self, k: int, ctx: torch.Tensor, path: torch.Tensor | None) -> torch.Tensor:
        if k != 0:
            raise ValueError(f"{self.arch} heads draft deeper recurrently, not with head k > 0")
        return ctx
