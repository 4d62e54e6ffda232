"""The decode backend: the pre-allocated KV cache and its in-place compaction, the grouped-KV
attention kernel, quantized bases, and compiled decoding, each against the plain path."""

from __future__ import annotations

import copy

import pytest
import torch

from evaluation.backend import BackendError, quantize_base, use_gqa_attention
from evaluation.decode import Decoder, new_cache
from evaluation.kvcache import CacheFull, PreallocatedCache, keep_accepted
from evaluation.tree import PRESETS, Tree
from evaluation.verify import base_forward, tree_attention_mask, tree_bias
from tests.helpers import make_heads

PROMPT = [5, 17, 3, 99, 42, 7, 61, 8, 23, 11]


@pytest.mark.parametrize("capacity", [None, 32])
def test_keep_accepted_moves_the_accepted_entries(tiny_base, capacity):
    model = tiny_base.model
    cache = new_cache(model, capacity)
    x = torch.randint(0, 200, (1, 9))
    base_forward(model, x, torch.arange(9)[None], cache)
    before = [layer.keys.clone() for layer in cache.layers]
    keep_accepted(cache, 4, torch.tensor([0, 2, 4]))
    assert cache.get_seq_length() == 7
    for layer, old in zip(cache.layers, before, strict=True):
        assert layer.keys.shape[2] == 7
        assert torch.equal(layer.keys[:, :, :4], old[:, :, :4])
        assert torch.equal(layer.keys[:, :, 4:], old[:, :, [4, 6, 8]])
    # the next forward writes right after the kept entries, in the same buffer
    base_forward(model, x[:, :2], torch.arange(7, 9)[None], cache)
    assert cache.get_seq_length() == 9


def test_preallocated_cache_gives_the_dynamic_caches_logits(tiny_base):
    """Prefill, a tree verify pass, compaction, then a one-token step: same hidden states to
    float tolerance from both caches, and the static one never reallocates its buffers."""
    model = tiny_base.model
    tree = Tree.from_paths(PRESETS["sparse_15"])
    bias = tree_bias(tree, torch.float32)
    ids = torch.tensor([PROMPT])
    tokens = torch.randint(0, 200, (1, tree.num_nodes))
    out = {}
    for name, cache in (("dynamic", new_cache(model)), ("static", new_cache(model, 64))):
        a, _ = base_forward(model, ids, torch.arange(10)[None], cache)
        b, _ = base_forward(
            model, tokens, (10 + tree.depth)[None], cache, tree_attention_mask(bias, 10)
        )
        ptr = getattr(cache.layers[0], "key_buf", cache.layers[0].keys).data_ptr()
        keep_accepted(cache, 10, torch.tensor([0, 2, 7]))
        c, _ = base_forward(model, torch.tensor([[9]]), torch.tensor([[13]]), cache)
        if name == "static":
            assert cache.layers[0].key_buf.data_ptr() == ptr  # written in place
        out[name] = (a, b, c)
    for x, y in zip(out["dynamic"], out["static"], strict=True):
        assert torch.allclose(x, y, atol=1e-5)


def test_a_full_cache_says_what_to_size(tiny_base):
    cache = PreallocatedCache(tiny_base.model.config.num_hidden_layers, 8)
    with pytest.raises(CacheFull, match="holds 8 positions and this forward needs 10"):
        base_forward(tiny_base.model, torch.tensor([PROMPT]), torch.arange(10)[None], cache)


@pytest.mark.parametrize("kv_cache", ["static", "dynamic"])
def test_both_caches_decode_the_same_tokens(tiny_base, kv_cache):
    heads = make_heads(tiny_base.model, "hydra_pp", 1, 0.05)
    ref = Decoder(tiny_base.model, set(), heads, kv_cache="dynamic").plain(PROMPT, 30).tokens
    dec = Decoder(tiny_base.model, set(), heads, Tree.from_paths(PRESETS["sparse_15"]),
                  kv_cache=kv_cache)  # fmt: skip
    assert dec.speculative(PROMPT, 30).tokens == ref
    assert dec.plain(PROMPT, 30).tokens == ref


def test_gqa_attention_equals_transformers_sdpa(tiny_base):
    """The grouped-KV kernel against transformers' own sdpa (which repeats the KV heads), with a
    tree mask over a cached prefix and without a mask."""
    assert tiny_base.model.config.num_key_value_heads < tiny_base.model.config.num_attention_heads
    ours = copy.deepcopy(tiny_base.model)
    use_gqa_attention(ours)
    assert ours.config._attn_implementation != tiny_base.model.config._attn_implementation
    tree = Tree.from_paths(PRESETS["sparse_7"])
    mask = tree_attention_mask(tree_bias(tree, torch.float32), 10)
    tokens = torch.randint(0, 200, (1, tree.num_nodes))
    outs = []
    for model in (tiny_base.model, ours):
        cache = new_cache(model)
        a, _ = base_forward(model, torch.tensor([PROMPT]), torch.arange(10)[None], cache)
        b, _ = base_forward(model, tokens, (10 + tree.depth)[None], cache, mask)
        outs.append(torch.cat([a, b]))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


@pytest.mark.parametrize("quant", ["bf16", "int8"])
def test_quantized_base_decodes_its_own_greedy_tokens_with_float32_heads(tiny_base, quant):
    """Plain decoding through our loop equals transformers' generate on the same quantized
    model; speculative decoding runs the float32 heads over it and emits valid tokens."""
    model = quantize_base(copy.deepcopy(tiny_base.model), quant)
    linear = type(model.model.layers[0].mlp.down_proj).__module__
    assert ("quantized" in linear) == (quant == "int8")
    assert (next(model.parameters()).dtype == torch.bfloat16) == (quant == "bf16")
    heads = make_heads(tiny_base.model, "hydra", 2, 0.05)
    dec = Decoder(model, set(), heads, Tree.from_paths(PRESETS["sparse_15"]))
    assert dec.embed.weight.dtype == torch.float32
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()  # fmt: skip
    assert dec.plain(PROMPT, 20).tokens == ref
    spec = dec.speculative(PROMPT, 20)
    assert len(spec.tokens) == 20 and spec.tau >= 1.0
    assert all(0 <= t < model.config.vocab_size for t in spec.tokens)


def test_unknown_quantization_fails_clearly(tiny_base):
    with pytest.raises(BackendError, match="eval.base_quant='fp4' is invalid"):
        quantize_base(tiny_base.model, "fp4")


def test_compiled_decoding_is_lossless_and_reports_its_compile_time(tiny_base):
    """eval.compile: one graph per (tokens per forward, capacity bucket), its compile time
    apart from the decode times, and the same tokens as eager plain greedy decoding."""
    heads = make_heads(tiny_base.model, "hydra_pp", 3, 0.05)
    ref = Decoder(tiny_base.model, set(), heads).plain(PROMPT, 24).tokens
    tree = Tree.from_paths(PRESETS["sparse_7"])
    dec = Decoder(tiny_base.model, set(), heads, tree, compile=True)
    spec = dec.speculative(PROMPT, 24)
    assert spec.tokens == ref
    assert dec.plain(PROMPT, 24).tokens == ref
    assert dec.compiled_shapes == {(1, 256), (tree.num_nodes, 256)}
    assert spec.compile_s > 0 and dec.compile_s >= spec.compile_s
    again = dec.speculative(PROMPT, 24)  # nothing left to compile
    assert again.tokens == ref and again.compile_s == 0
    # another prompt and length: the graphs write into the bucket's one cache, not a stale one
    longer = list(range(5, 35))
    ref = Decoder(tiny_base.model, set(), heads).plain(longer, 150).tokens
    assert dec.speculative(longer, 150).tokens == ref
    with pytest.raises(ValueError, match="compile=True needs kv_cache='static'"):
        Decoder(tiny_base.model, set(), heads, kv_cache="dynamic", compile=True)
