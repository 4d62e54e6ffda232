"""The engine's one KV cache: writes in place, every layer's compaction in one gather / scatter,
per-row moves, rows leaving, leading columns dropped, and the same attention as no cache."""

from __future__ import annotations

import pytest
import torch

from train.decoding.backend import forward
from train.decoding.cache import CacheFull, KVCache, new_cache
from train.decoding.tree import PRESETS, Tree, tree_bias

PROMPT = [5, 17, 3, 99, 42, 7, 61, 8, 23, 11]


def test_a_compacted_cache_attends_like_the_accepted_sequence_without_cache(tiny_base):
    """Prefill, a tree verify pass, keep one root-to-node path, then a one-token step: its
    hidden state is that of a forward, without cache, over prompt + path + token; and the
    buffer is written in place, never reallocated."""
    model = tiny_base.model
    tree = Tree.from_paths(PRESETS["sparse_15"])
    path = [int(i) for i in tree.ancestors[tree.num_nodes - 1] if i >= 0]  # deepest last node
    assert len(path) >= 3 and path != list(range(len(path)))  # entries really move
    cache = new_cache(model, 64)
    forward(model, torch.tensor([PROMPT]), torch.arange(10)[None], cache)
    tokens = torch.randint(0, 200, (1, tree.num_nodes))
    mask = torch.zeros(1, 1, tree.num_nodes, 10 + tree.num_nodes)
    mask[0, 0, :, 10:] = tree_bias(tree, torch.float32)
    forward(model, tokens, (10 + tree.depth)[None], cache, mask)
    ptr = cache.buf.data_ptr()
    n = len(path)
    cache.keep(10 + torch.tensor([path]), 10 + torch.arange(n)[None], 10 + n)
    assert cache.get_seq_length() == 10 + n
    step, _ = forward(model, torch.tensor([[9]]), torch.tensor([[10 + n]]), cache)
    assert cache.buf.data_ptr() == ptr
    seq = PROMPT + tokens[0, path].tolist() + [9]
    ref, _ = forward(model, torch.tensor([seq]), torch.arange(len(seq))[None], new_cache(model, 64))
    assert torch.allclose(step[0, -1], ref[0, -1], atol=1e-5)


def test_keep_moves_each_rows_accepted_entries_in_every_layer():
    """Rows of lengths 3 and 5 wrote a 4-node tree at slots 5..8; row 0 keeps nodes 0, 2, row 1
    nodes 0, 1, 3 (row 0 repeats its last pair to pad). Each row's prefix stays; its accepted
    entries follow its own prefix; keys and values alike, in both layers."""
    cache = KVCache(2, 16)
    keys = torch.arange(2 * 1 * 9, dtype=torch.float32).view(2, 1, 9, 1)
    for layer in cache.layers:
        layer.update(keys.clone(), keys.clone() + 100)
    assert cache.end == 9
    src = 5 + torch.tensor([[0, 2, 2], [0, 1, 3]])
    dst = torch.tensor([[3, 4, 4], [5, 6, 7]])
    cache.keep(src, dst, 8)
    assert cache.get_seq_length() == 8
    for layer in cache.layers:
        k = layer.keys[:, 0, :, 0]
        assert k.shape == (2, 8)
        assert k[0, :5].tolist() == [0, 1, 2, 5, 7]  # prefix 0..2, then tree slots 5 and 7
        assert k[1].tolist() == [9, 10, 11, 12, 13, 14, 15, 17]
        assert torch.equal(layer.values[:, 0, :, 0], k + 100)
    cache.select_rows(torch.tensor([1]))  # row 0 leaves
    assert cache.layers[1].keys[:, 0, :, 0].tolist() == [[9, 10, 11, 12, 13, 14, 15, 17]]
    cache.trim(2)  # the left-padded strategy drops leading columns
    assert cache.get_seq_length() == 6
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [11, 12, 13, 14, 15, 17]


def test_insert_right_aligns_a_group_and_writes_continue_after_it():
    small = KVCache(1, 4)
    small.layers[0].update(torch.ones(2, 1, 3, 2), torch.ones(2, 1, 3, 2) * 2)
    big = KVCache(1, 8)
    big.allocate_like(small, 3)
    big.insert(small, torch.tensor([0, 2]), 5)
    big.end = 5
    k = big.layers[0].keys[:, 0, :, 0]
    assert k.tolist() == [[0, 0, 1, 1, 1], [0] * 5, [0, 0, 1, 1, 1]]
    big.layers[0].update(torch.full((3, 1, 1, 2), 7.0), torch.zeros(3, 1, 1, 2))
    assert big.end == 6 and big.layers[0].keys[:, 0, -1, 0].tolist() == [7, 7, 7]


def test_a_full_cache_says_what_to_size(tiny_base):
    cache = KVCache(tiny_base.model.config.num_hidden_layers, 8)
    with pytest.raises(CacheFull, match="holds 8 positions and this forward needs 10"):
        forward(tiny_base.model, torch.tensor([PROMPT]), torch.arange(10)[None], cache)


def test_a_dropped_cache_frees_its_buffer_at_once(tiny_base):
    """No reference cycle between the cache and its layers: the buffer goes when the last
    reference does, not at the cyclic collector's next run (regeneration's memory grew by a
    batch's buffer a batch until killed). Checked with the collector off, on a real
    regeneration batch whose rows finish at different steps (select_rows, trim)."""
    import gc
    import weakref

    from train.decoding.slab import generate_left_padded

    cache = KVCache(2, 16)
    cache.layers[0].update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    buf = weakref.ref(cache.buf)
    gc.disable()
    try:
        del cache
        assert buf() is None
        gc.collect()  # whatever earlier tests left
        torch.manual_seed(0)
        prompts = [PROMPT, PROMPT[:4], PROMPT[:7] * 2]
        tails = [[1, 2]] * len(prompts)
        out, _ = generate_left_padded(tiny_base.model, prompts, 12, {3, 5, 7}, 0, 1.0, 1.0, tails)
        assert len({len(o) for o in out}) > 1  # rows left the batch at different steps
        assert not [o for o in gc.get_objects() if type(o) is KVCache]
    finally:
        gc.enable()
