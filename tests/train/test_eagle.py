"""Hydra's eagle-attn head (head=hydra_eagle): its config, recurrent drafting (and
cross-attn's) against the unrolled teacher-forced chain, and exact agreement with a stand-in
built to zankner/Hydra's EagleAttentionDecoderLayer (its structure and state-dict names),
through format=hydra."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tests.helpers import head_config, official_round_trip, random_one_layer_heads
from train.core.errors import ConfigError
from train.decoding.cache import KVCache
from train.decoding.recurrent import DraftMemory, recurrent_step, unroll
from train.heads import base_shape
from train.heads.blocks import layer_config


def make(tiny_base, seed: int = 0, name: str = "hydra_eagle", **head):
    return random_one_layer_heads(tiny_base, name, seed, **head)


def test_config_names_what_eagle_attn_allows():
    for key, value in (("num_heads", 2), ("num_layers", 3), ("dropout", 0.1), ("bias", True)):
        with pytest.raises(ConfigError, match=f"'{key}'"):
            head_config("hydra_eagle", **{key: value})


def test_only_the_layer_trains_and_the_lm_head_is_the_base_s(tiny_base):
    heads = make(tiny_base)
    frozen = [n for n, p in heads.named_parameters() if not p.requires_grad]
    assert frozen == ["lm_heads.0.weight"]
    assert torch.equal(heads.lm_heads[0].weight, tiny_base.lm_head.weight)
    assert heads.recurrent and heads.depth_limit is None and heads.draft_depth == 4
    assert {n.split(".")[0] for n, p in heads.named_parameters() if p.requires_grad} == {
        "fc",
        "attn",
    }


@pytest.mark.parametrize("name", ["hydra_eagle", "hydra_cross_attn", "eagle3"])
def test_drafting_on_a_path_equals_the_unrolled_chain(tiny_base, name):
    """What decoding drafts along a path (context over the prefix, then one step per depth
    attending to the prefix and the node's ancestors) is what calibration's unroll computes at
    that position, at every depth; and a sibling drafted beside the path changes nothing."""
    heads = make(tiny_base, name=name)
    embed = tiny_base.embed_tokens
    T, t = 14, 8
    torch.manual_seed(3)
    ids = torch.randint(0, tiny_base.vocab_size, (T,))
    hidden = torch.randn(T, 3 * 64 if name == "eagle3" else 64)  # eagle3: 3 fused layers
    chain = unroll(heads, hidden, ids, embed, 4)
    cache = KVCache(1, 64)
    # the accepted prefix 0..t: contexts read x_{p+1}
    ctx = heads.context(hidden[None, : t + 1], cache=cache, next_emb=embed(ids[None, 1 : t + 2]))
    mem = DraftMemory(cache, torch.tensor([t + 1]), t + 1, torch.float32)
    assert torch.allclose(ctx[0, t], chain[0][0, t], atol=1e-5)
    state = ctx[:, t][:, None]
    for d in range(1, 4):
        # the path node at depth d and a decoy sibling beside it; both descend from the path
        # nodes (not the decoys) drafted at the depths before
        toks = torch.stack([ids[t + d + 1], (ids[t + d + 1] + 5) % tiny_base.vocab_size])[None]
        anc = torch.tensor([True, False] * (d - 1), dtype=torch.bool).expand(1, 2, -1)
        out = recurrent_step(heads, embed, mem, toks, state.expand(1, 2, -1), d, anc)
        # float32 to a few ulps of these magnitudes (|x| ~ 40): AVX2 and AVX-512 kernels
        # sum in different orders, so a bare atol=1e-5 failed on an AMD EPYC at depth 3
        torch.testing.assert_close(out[0, 0], chain[d][0, t], rtol=1e-5, atol=1e-4, msg=str(d))
        assert not torch.allclose(out[0, 1], chain[d][0, t], atol=1e-3)
        state = out[:, :1]
    assert cache.end == t + 1 + 6  # each depth's two nodes appended (the decoder drops them)


class OfficialEagle(nn.Module):
    """zankner/Hydra's EagleAttentionDecoderLayer as its code builds it: `fc` (2H -> H, bias) over
    [token embedding; hidden], one LlamaDecoderLayer `attn`, the base `lm_head` (no norm
    before it), the base `input_embed_fn`; its training forward (ids rolled by -1, causal,
    positions 0..T-1) and a chain proposal (depth-d node at position T + d)."""

    def __init__(self, config, embed: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        H = config.hidden_size
        self.input_embed_fn, self.lm_head = embed, lm_head
        self.attn = LlamaDecoderLayer(config, layer_idx=0)
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.rope = LlamaRotaryEmbedding(config)

    def load(self, state: dict) -> None:
        missing, unexpected = self.load_state_dict(state, strict=False)
        assert unexpected == [] and set(missing) == {"input_embed_fn.weight"}

    def _attn(self, x, pos, mask):
        cos_sin = self.rope(x, pos[None])
        return self.attn(
            x, attention_mask=mask, position_ids=pos[None], position_embeddings=cos_sin
        )

    def training_logits(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        T = ids.shape[0]
        emb = self.input_embed_fn(torch.roll(ids, -1))
        x = self.fc(torch.cat([emb, hidden], dim=-1))[None]
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        return self.lm_head(self._attn(x, torch.arange(T), causal))[0]

    def chain_logits(self, ids: torch.Tensor, hidden: torch.Tensor, drafts: list[int]):
        """Logits drafting the chain after prefix ids (T,) whose last token's successor is
        drafts[0] (the root), each later draft fed back with the previous output state."""
        T = ids.shape[0]
        nxt = torch.cat([ids[1:], torch.tensor([drafts[0]])])
        feats = [self.fc(torch.cat([self.input_embed_fn(nxt), hidden], -1))[None]]
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        outs = self._attn(feats[0], torch.arange(T), causal)
        logits, state = [self.lm_head(outs[:, -1])], outs[:, -1:]
        for d, tok in enumerate(drafts[1:], start=1):
            x = self.fc(torch.cat([self.input_embed_fn(torch.tensor([[tok]])), state], -1))
            feats.append(x)
            seq = torch.cat(feats, 1)  # prefix features, then the chain's, in order
            n = seq.shape[1]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            pos = torch.cat([torch.arange(T), T - 1 + torch.arange(1, d + 1)])
            state = self._attn(seq, pos, mask)[:, -1:]
            logits.append(self.lm_head(state[:, 0]))
        return torch.cat(logits)


def test_format_hydra_round_trip_matches_the_official_module(tmp_path, tiny_base):
    """Exported as format=hydra, the heads load into the official structure (names and
    shapes, strict but for the base's embedding table) and give its logits in training and
    along a drafted chain; imported back, they are the same heads."""
    config = layer_config(base_shape(tiny_base.config))
    lm = nn.Linear(64, tiny_base.vocab_size, bias=False)
    official = OfficialEagle(config, tiny_base.embed_tokens, lm)
    official_round_trip(tmp_path, tiny_base, make(tiny_base, seed=1), official, "eagle-attn")


@pytest.mark.parametrize(("name", "arch"), [("hydra_eagle", "eagle-attn"),
                                            ("hydra_cross_attn", "cross-attn"),
                                            ("eagle3", None)])  # fmt: skip
def test_recurrent_heads_train_and_decode_losslessly_from_the_cli(
    tmp_path, tiny_prepared, name, arch
):
    """`train head=hydra_eagle` (and cross-attn) then `eval` on every kind of tree: a
    calibrated one (measured by unrolling the layer on its own states, four depths deep from
    one head), a chain as deep as the recurrent default, a dynamic one; all lossless. Then
    `export format=hydra` (eagle3: format=eagle3, EAGLE-3's layout, trained with 2 steps of
    training-time test)."""
    from tests.helpers import run_here

    out = tmp_path / "run"
    r = run_here(
        "train",
        "base=tiny_random",
        f"head={name}",
        f"data.prepared={tiny_prepared}",
        f"out={out}",
        "trainer.max_steps=30",
        "trainer.val_check_interval=1000",
        "final_validation=false",
        "data.batch_size=4",
        "optim.lr=3e-3",
        *(["head.num_heads=2"] if name == "eagle3" else []),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    heads = out / "heads"
    common = ("eval.num_prompts=2", "eval.max_new_tokens=16")
    trees = {
        "calibrated": ("tree=calibrated", "tree.budget=8", "tree.calibration_rows=4"),
        "chain": ("tree=chain",),
        "dynamic": ("tree=dynamic", "tree.budget=8"),
    }
    for kind, tree in trees.items():
        ev = tmp_path / kind
        r = run_here("eval", f"heads={heads}", f"out={ev}", *tree, *common)
        assert r.returncode == 0, (kind, r.stderr[-3000:])
        res = json.loads((ev / "eval.json").read_text())
        assert res["lossless"] is True and res["arch"] == name, tree
        if tree[0] == "tree=calibrated":
            assert len(res["tree"]["calibration"]["acc"]) == 4  # one head, four depths
        if tree[0] == "tree=chain":
            assert res["tree"]["depth"] == 4 and res["tree"]["num_nodes"] == 4
    fmt = "eagle3" if name == "eagle3" else "hydra"
    r = run_here("export", f"heads={heads}", f"format={fmt}", f"out={tmp_path / 'x'}")
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    if name == "eagle3":  # the recipe's draft vocab: every token of the tiny tokenizer's
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"]
    else:
        assert cfg["hydra_head_arch"] == arch
