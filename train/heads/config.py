"""Schema of a head set and its loss (`conf/head/*.yaml`); the values live in conf/ only."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import model_validator

from train.core.config import ConfigModel, NonNegative, Positive, check, fail

# Head sets of one layer that draft recurrently (their classes say `recurrent = True`).
RECURRENT = ("hydra_eagle", "hydra_cross_attn", "eagle3")
# Of those, the ones trained unrolled on their own states ("training-time test", EAGLE-3): their
# num_heads is the number of unrolled steps, all scored by the one lm head.
UNROLLED = ("eagle3",)

# The distillation divergences of train/losses.py, the one list of their names.
KINDS = ("kl", "reverse_kl", "jsd", "tv", "lk", "top1")


class LossConfig(ConfigModel):
    """How head outputs are scored (`head.loss`)."""

    lm_weight: Annotated[float, check(lambda v: v >= 0, "a weight >= 0")]  # CE on the data
    distill_weight: Annotated[float, check(lambda v: v >= 0, "a weight >= 0")]  # to the base
    # The distillation divergence (train/losses.py): kl (the paper's), reverse_kl, jsd, tv, lk
    # (acceptance: -log sum min(p, q)), top1 (CE against the base's argmax), or mix: the
    # weighted sum of `mix`, {kind: weight}.
    kind: Literal[(*KINDS, "mix")]  # type: ignore[valid-type]
    mix: dict[str, float] | None
    temperature: Annotated[float, check(lambda v: v > 0, "a number > 0")]
    head_weighting: Literal["constant", "geometric"]
    head_decay: Annotated[float, check(lambda v: 0 < v <= 1, "a number in (0, 1]")]
    chunk_size: Positive  # positions per logits chunk: bounds memory to chunk x vocab

    @model_validator(mode="after")
    def _some_loss(self) -> LossConfig:
        if self.lm_weight == 0 and self.distill_weight == 0:
            fail("distill_weight", 0, "lm_weight and distill_weight cannot both be 0")
        if self.kind == "mix":
            kinds = ", ".join(KINDS)
            if not self.mix:
                example = "{kl: 0.5, lk: 0.5}"
                fail("mix", self.mix, f"kind=mix needs weights, e.g. {example} ({kinds})")
            bad = [k for k in self.mix if k not in KINDS]
            if bad:
                fail("mix", self.mix, f"unknown kind {bad[0]!r}: the kinds are {kinds}")
            if any(w < 0 for w in self.mix.values()) or sum(self.mix.values()) <= 0:
                fail("mix", self.mix, "weights >= 0, not all 0")
        elif self.mix is not None:
            fail("mix", self.mix, f"mix is for kind=mix (kind is {self.kind}); set it to null")
        return self

    def distill_kinds(self) -> dict[str, float]:
        """The distillation divergence as {kind: weight}."""
        return dict(self.mix) if self.kind == "mix" else {self.kind: 1.0}

    def head_weights(self, k: int) -> list[float]:
        """w_1..w_k: all 1 (constant), or head_decay**(k-1) (geometric, Medusa-1)."""
        if self.head_weighting == "constant":
            return [1.0] * k
        return [self.head_decay**i for i in range(k)]


class HeadConfig(ConfigModel):
    """Architecture of a draft head set."""

    name: Literal["medusa", "hydra", "hydra_pp", "hydra_eagle", "hydra_cross_attn", "eagle3"]
    num_heads: Annotated[int, check(lambda v: 1 <= v <= 16, "an integer in [1, 16]")]
    num_layers: Positive  # residual MLP blocks per head (blocks 2..L shared: tie_blocks)
    hidden_state_offset: NonNegative  # 0: last (post-norm) state; n: n-th layer from the last
    # eagle3: the base's hidden states its fc fuses, as indices of transformers' hidden_states
    # (0: the embeddings, i: the input of layer i); null: EAGLE-3's (2, N // 2, N - 3)
    aux_layers: list[NonNegative] | None
    # predict only the N most frequent training tokens (null: the full vocab)
    draft_vocab_size: Annotated[int, check(lambda v: v >= 16, "null (full vocab) or >= 16")] | None
    noise_alpha: Annotated[float, check(lambda v: v >= 0, "a number >= 0")]  # NEFTune noise
    dropout: Annotated[float, check(lambda v: 0 <= v < 1, "a number in [0, 1)")]
    # Biases on the output projections and on a head's input projection, as zankner/Hydra's
    # heads have (`hydra_lm_head`, `res_connection`); the base lm_head has none.
    bias: bool
    # Blocks that map H -> H share one set of weights, as zankner/Hydra's `[ResBlock] * n`
    # builds them: blocks 2..L of a Hydra / Hydra++ head, all L blocks of a Medusa head.
    tie_blocks: bool
    # An extra: the heads' output projections stay the base's lm_head rows (as EAGLE's), so
    # a step computes no V x H weight gradient and AdamW keeps no state for them. Official
    # Hydra / Medusa heads train their own (false).
    freeze_lm_heads: bool
    # ours: every head starts as the base lm_head (zero residual blocks, identity projections,
    # extra layer = its final norm); official: zankner/Hydra's (random projections and biases).
    init: Literal["ours", "official"]
    loss: LossConfig

    @model_validator(mode="after")
    def _one_recurrent_layer(self) -> HeadConfig:
        if self.name in RECURRENT:  # zankner/Hydra's eagle-attn, cross-attn, EAGLE-3: one layer
            why = f"{self.name} is one layer drafting recurrently (tree depth: the tree's)"
            wants = [("num_layers", 1), ("dropout", 0.0)]
            if self.name not in UNROLLED:  # eagle3's num_heads: its training-time test steps
                wants.insert(0, ("num_heads", 1))
            for key, want in wants:
                if getattr(self, key) != want:
                    fail(key, getattr(self, key), f"{want} ({why})")
            if self.bias:
                fail("bias", True, f"false ({self.name}'s lm head has no bias)")
        if self.freeze_lm_heads and self.bias and self.init == "official":
            fail(
                "bias",
                True,
                "false with head.freeze_lm_heads=true and head.init=official (its random "
                "lm head biases would stay random), or head.init=ours (zero biases)",
            )
        if self.name == "eagle3" and self.hidden_state_offset:
            fail("hidden_state_offset", self.hidden_state_offset, "0 (eagle3 reads aux_layers)")
        if self.aux_layers is not None:
            if self.name != "eagle3":
                fail(
                    "aux_layers",
                    self.aux_layers,
                    f"null (only eagle3 fuses layers, not {self.name})",
                )
            layers = self.aux_layers
            if not layers or any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
                # the engines capture the layers in increasing order, and fc's blocks with them
                fail("aux_layers", layers, "increasing layer indices, e.g. [2, 15, 27], or null")
        return self
