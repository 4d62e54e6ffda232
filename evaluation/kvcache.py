"""A pre-allocated KV cache for decoding: fixed buffers, writes in place, compaction in place.

transformers' `DynamicCache` concatenates every layer's keys and values on every forward, so a
decode step copies the whole prefix once per layer (O(context) per step). Here each layer owns
one (B, H_kv, capacity, D) buffer sized for the whole generation up front. A forward writes its
new entries at [length, length + n) and attends over a view of [0, length + n); a speculative
step then keeps the accepted tree nodes by moving their few entries down to sit after the
prefix, in the same buffer. Nothing else is copied and nothing is allocated per step.

The cache is a `transformers.Cache` made of `PreallocatedLayer`s, so the base model (and the
Hydra++ extra layer, which is a Llama decoder layer too) use it through their normal forward.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, StaticLayer


class CacheFull(RuntimeError):
    """A forward would write past the cache's capacity."""


class PreallocatedLayer(CacheLayerMixin):
    """One layer's keys and values in buffers allocated on first use."""

    is_compileable = False
    is_sliding = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = int(capacity)
        self.length = 0  # entries in use, the last forward's included
        self.key_buf: torch.Tensor | None = None  # (B, H_kv, capacity, D)
        self.value_buf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.device = key_states.device
        self.key_buf = key_states.new_zeros(B, H, self.capacity, D)
        self.value_buf = value_states.new_zeros(B, H, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.capacity:
            raise CacheFull(
                f"the KV cache holds {self.capacity} positions and this forward needs {end}: "
                "size it for prompt + max_new_tokens + the tree's nodes"
            )
        self.key_buf[:, :, self.length : end].copy_(key_states)
        self.value_buf[:, :, self.length : end].copy_(value_states)
        self.length = end
        self.keys = self.key_buf[:, :, :end]
        self.values = self.value_buf[:, :, :end]
        return self.keys, self.values

    def keep(self, past: int, m: int, idx: torch.Tensor | None) -> None:
        """Keep [0, past) and the m entries at positions `idx` (ascending; None: already at
        [past, past + m)), moved to [past, past + m)."""
        if self.is_initialized:
            if idx is not None:
                # index_select copies the kept entries out first: overlapping moves are safe
                self.key_buf[:, :, past : past + m] = self.key_buf.index_select(2, idx)
                self.value_buf[:, :, past : past + m] = self.value_buf.index_select(2, idx)
            self.keys = self.key_buf[:, :, : past + m]
            self.values = self.value_buf[:, :, : past + m]
        self.length = past + m

    def crop(self, length: int) -> None:
        self.length = min(self.length, max(int(length), 0))
        if self.is_initialized:
            self.keys = self.key_buf[:, :, : self.length]
            self.values = self.value_buf[:, :, : self.length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0


class PreallocatedCache(Cache):
    """A KV cache of `num_layers` pre-allocated layers holding up to `capacity` positions."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])
        self.capacity = int(capacity)

    def crop(self, max_length: int) -> None:
        """As DynamicCache.crop: keep the first `max_length` positions, or drop the last
        -max_length when it is negative."""
        length = max_length if max_length >= 0 else self.get_seq_length() + max_length
        for layer in self.layers:
            layer.crop(length)


def num_cache_layers(model) -> int:
    """Decoder layers of a transformers causal LM (or of its inner model)."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    if n is None:
        raise ValueError(f"cannot tell how many layers {type(model).__name__} has")
    return int(n)


def keep_accepted(cache, past: int, nodes: torch.Tensor) -> None:
    """Keep the prefix [0, past) and the accepted tree nodes `nodes` (ascending, root first)
    in `cache`, moved to sit right after the prefix; the rejected nodes' entries are dropped.
    No position is recomputed: each accepted node already attended to exactly its own path.
    Works on a PreallocatedCache and transformers' StaticCache (in place) and on its
    DynamicCache."""
    n = int(nodes.numel())
    moved = not bool((nodes == torch.arange(n, device=nodes.device)).all())
    idx = nodes + past if moved else None  # once for every layer
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer):
            layer.keep(past, n, idx)
        elif isinstance(layer, StaticLayer):  # compiled decoding's cache: buffers in place
            if idx is not None:
                layer.keys[:, :, past : past + n] = layer.keys.index_select(2, idx)
                layer.values[:, :, past : past + n] = layer.values.index_select(2, idx)
            layer.cumulative_length.fill_(past + n)
        else:  # DynamicCache
            if idx is not None:
                layer.keys[:, :, past : past + n] = layer.keys[:, :, idx]
                layer.values[:, :, past : past + n] = layer.values[:, :, idx]
            layer.keys = layer.keys[:, :, : past + n]
            layer.values = layer.values[:, :, : past + n]


# -- batched decoding: rows with their own lengths in one buffer --------------------------------
# Every forward of a batch writes its n new entries at the same slots [start, start + n) of
# every row: start is the longest row's length. A row that holds fewer positions has a hole of
# stale slots between its length and `start`, which the batch's attention mask hides from it.
# After a verify pass each row keeps its own accepted nodes, moved down to follow its own
# prefix; then the next write starts at the new longest length.
def _layer_tensors(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (B, H, S, D) tensors a layer's entries live in, or None before its first write."""
    if isinstance(layer, PreallocatedLayer):
        return (layer.key_buf, layer.value_buf) if layer.is_initialized else None
    keys = getattr(layer, "keys", None)
    return (
        None if keys is None or not getattr(layer, "is_initialized", True) else (keys, layer.values)
    )


def _set_length(layer, length: int) -> None:
    if isinstance(layer, PreallocatedLayer):
        layer.crop(length)  # a forward wrote past it: length <= the layer's
    elif isinstance(layer, StaticLayer):
        layer.cumulative_length.fill_(length)
    elif getattr(layer, "keys", None) is not None:  # DynamicCache
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def pad_nodes(nodes: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of accepted nodes of different lengths as one (B, m) tensor: (n (B,) lengths,
    col (B, m) column indices, padded (B, m) nodes). A shorter row repeats its last node."""
    n = torch.tensor([int(x.numel()) for x in nodes], device=device)
    col = torch.minimum(torch.arange(int(n.max()), device=device)[None], (n - 1)[:, None])
    padded = torch.stack([x.to(device)[col[b]] for b, x in enumerate(nodes)])
    return n, col, padded


def keep_rows(cache, lengths: torch.Tensor, start: int, nodes: list[torch.Tensor]) -> int:
    """Batched keep_accepted. Row b holds [0, lengths[b]) and wrote its tree at [start,
    start + N); it keeps its accepted nodes `nodes[b]` (ascending, root first), moved to
    [lengths[b], lengths[b] + n_b). Returns the new write position, max_b(lengths + n_b).
    Each row's few entries move in one gather / scatter per tensor."""
    # a shorter row repeats its last node into its last slot: same value, same place
    n, col, padded = pad_nodes(nodes, lengths.device)
    src, dst = start + padded, lengths[:, None] + col
    new_start = int((lengths + n).max())
    moved = not torch.equal(src, dst)
    for layer in cache.layers:
        tensors = _layer_tensors(layer) if moved else None
        for t in tensors or ():
            B, H, _, D = t.shape
            s_idx = src[:, None, :, None].expand(B, H, -1, D).to(t.device)
            d_idx = dst[:, None, :, None].expand(B, H, -1, D).to(t.device)
            t.scatter_(2, d_idx, t.gather(2, s_idx))  # gather copies first: overlap is safe
        _set_length(layer, new_start)
    return new_start


def select_rows(cache, rows: torch.Tensor, length: int) -> None:
    """Keep only batch rows `rows` (finished rows leave the batch), holding `length` slots."""
    for layer in cache.layers:
        tensors = _layer_tensors(layer)
        if tensors is None:
            continue
        k, v = (t.index_select(0, rows.to(t.device)) for t in tensors)
        if isinstance(layer, PreallocatedLayer):
            layer.key_buf, layer.value_buf = k, v
            layer.length = length
            layer.keys, layer.values = k[:, :, :length], v[:, :, :length]
        else:
            layer.keys, layer.values = k[:, :, :length], v[:, :, :length]
