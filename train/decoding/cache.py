"""The one KV cache of decoding: every layer's keys and values in one pre-allocated buffer.

transformers' `DynamicCache` concatenates every layer's keys and values on every forward, so a
decode step copies the whole prefix once per layer. Here one (L, 2, B, H_kv, capacity, D)
tensor holds every layer of every row for the whole generation, allocated on the first write.
A forward writes its n new entries at the same slots [end, end + n) of every row and layer
attends over a view of [lo, end + n). The base model and Hydra++'s extra layer (a Llama
decoder layer too) both use it through their normal forward: it is a `transformers.Cache`
whose layers are views of the buffer.

Rows hold different numbers of positions (batched decoding): row b's own entries are
[lo, lo + length_b), and the slots between its length and `end` are a hole the decoder's
attention mask hides. Compaction is one indexed copy out and back over the whole buffer, every
layer at once (`keep`): after a verify pass each row's accepted tree nodes move down to follow
its own prefix. Rows that finish leave in place (`select_rows`), and leading columns that are
padding in every row can be dropped (`trim`, the left-padded regeneration strategy).
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, StaticLayer


class CacheFull(RuntimeError):
    """A forward would write past the cache's capacity."""


class KVLayer(CacheLayerMixin):
    """One layer of a KVCache: views of the shared buffer. The cache's write position moves
    on when its last layer has written, so a forward needs no per-layer bookkeeping."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: KVCache, index: int):
        # not CacheLayerMixin.__init__: its keys / values attributes are views here
        # A weak proxy: the cache holds its layers, and a layer holding its cache back would
        # be a reference cycle, which frees the buffer (gigabytes for a regeneration batch)
        # only when the cyclic garbage collector next runs, not when the cache is dropped:
        # regeneration's memory grew ~1 GB a shard of 256 conversations until killed.
        self.owner = weakref.proxy(owner)
        self.index = index
        self.is_initialized = True  # the buffer is the owner's, allocated on first write

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner.allocate(key_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        c = self.owner
        if c.buf is None:
            c.allocate(key_states)
        n = key_states.shape[-2]
        end = c.end + n
        if end > c.capacity:
            raise CacheFull(
                f"the KV cache holds {c.capacity} positions and this forward needs {end}: "
                "size it for prompt + max_new_tokens + the tree's nodes"
            )
        kv = c.buf[self.index, :, : c.rows]  # (2, B, H, capacity, D)
        kv[0, :, :, c.end : end] = key_states
        kv[1, :, :, c.end : end] = value_states
        if self.index == c.num_layers - 1:
            c.end = end
        return kv[0, :, :, c.lo : end], kv[1, :, :, c.lo : end]

    @property
    def keys(self) -> torch.Tensor | None:
        c = self.owner
        return None if c.buf is None else c.buf[self.index, 0, : c.rows, :, c.lo : c.end]

    @property
    def values(self) -> torch.Tensor | None:
        c = self.owner
        return None if c.buf is None else c.buf[self.index, 1, : c.rows, :, c.lo : c.end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.end - self.owner.lo + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.end - self.owner.lo

    def get_max_length(self) -> int:
        return self.owner.capacity

    def reset(self) -> None:
        self.owner.end = self.owner.lo = 0


class KVCache(Cache):
    """A KV cache of `num_layers` layers and up to `capacity` positions per row."""

    def __init__(self, num_layers: int, capacity: int):
        self.num_layers = int(num_layers)
        self.capacity = int(capacity)
        self.buf: torch.Tensor | None = None  # (L, 2, B, H_kv, capacity, D)
        self.rows = 0  # live rows: the buffer's first `rows`
        self.lo = 0  # first live column (regeneration drops leading padding)
        self.end = 0  # next write position
        super().__init__(layers=[KVLayer(self, i) for i in range(self.num_layers)])

    def allocate(self, key_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        # zeros, not empty: hole slots are masked, but NaN garbage would survive 0 * NaN
        self.buf = key_states.new_zeros(self.num_layers, 2, B, H, self.capacity, D)
        self.rows = B

    def allocate_like(self, other: KVCache, rows: int) -> None:
        """A buffer of `rows` rows shaped and typed like `other`'s."""
        L, _, _, H, _, D = other.buf.shape
        self.buf = other.buf.new_zeros(L, 2, rows, H, self.capacity, D)
        self.rows = rows

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.end - self.lo

    def crop(self, max_length: int) -> None:
        """As DynamicCache.crop: keep the first `max_length` positions (or drop the last
        -max_length)."""
        length = max_length if max_length >= 0 else self.get_seq_length() + max_length
        self.end = self.lo + max(min(length, self.end - self.lo), 0)

    def keep(self, src: torch.Tensor, dst: torch.Tensor, end: int) -> None:
        """Move each row's entries at slots src[b] to dst[b] ((B, m) column indices, relative
        to `lo`; a row may repeat its last pair) in every layer at once, then write next at
        `end`. The entries are copied out first, so overlapping moves are safe."""
        if self.buf is not None and not torch.equal(src, dst):
            live = self.buf[:, :, : self.rows, :, self.lo :]  # (L, 2, B, H, S, D)
            src, dst = src.to(live.device), dst.to(live.device)
            rows = torch.arange(src.shape[0], device=live.device)[:, None].expand_as(src)
            # advanced indexing on the row and slot dims at once: one copy out, one write
            # back (on 2 CPU cores 100x faster than gather / scatter with expanded indices)
            live[:, :, rows, :, dst] = live[:, :, rows, :, src]
        self.end = self.lo + int(end)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows `rows` (ascending), moved up in place: finished rows leave."""
        if self.buf is not None:
            live = self.buf[:, :, : self.rows]
            live[:, :, : len(rows)] = live.index_select(2, rows.to(live.device))
        self.rows = len(rows)

    def trim(self, lead: int) -> None:
        """Drop the first `lead` live columns (padding in every live row)."""
        self.lo += int(lead)

    def insert(self, other: KVCache, rows: torch.Tensor, at: int) -> None:
        """Copy `other`'s live entries into rows `rows` of this cache, right-aligned to end at
        column `at` (regeneration prefills its rows in groups, then decodes them together)."""
        w = other.end - other.lo
        src = other.buf[:, :, : other.rows, :, other.lo : other.end]
        self.buf[:, :, rows.to(self.buf.device), :, at - w : at] = src


def new_cache(model, capacity: int) -> KVCache:
    """The base's KV cache for one generation of up to `capacity` positions per row."""
    return KVCache(num_layers(model), capacity)


def num_layers(model) -> int:
    """Decoder layers of a transformers causal LM (or of its inner model)."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    if n is None:
        raise ValueError(f"cannot tell how many layers {type(model).__name__} has")
    return int(n)


def keep_static(cache, past: int, nodes: torch.Tensor) -> None:
    """Compiled decoding's cache (transformers' StaticCache, batch 1, whose buffers a compiled
    graph holds on to): keep [0, past) and the accepted tree nodes `nodes` (ascending, root
    first), moved to sit right after the prefix."""
    n = int(nodes.numel())
    moved = not bool((nodes == torch.arange(n, device=nodes.device)).all())
    idx = nodes + past
    for layer in cache.layers:
        if not isinstance(layer, StaticLayer):
            raise TypeError(f"keep_static needs a StaticCache, got a {type(layer).__name__}")
        if moved and layer.is_initialized:
            layer.keys[:, :, past : past + n] = layer.keys.index_select(2, idx)
            layer.values[:, :, past : past + n] = layer.values.index_select(2, idx)
        if layer.is_initialized:
            layer.cumulative_length.fill_(past + n)
