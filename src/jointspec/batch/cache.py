"""The KV cache of a batch of sequences that grow by different amounts each round.

One Hugging Face ``DynamicCache`` holds every row, so one forward pass serves the whole batch; its key/value tensors
stay rectangular, ``[batch, kv_heads, num_slots, head_dim]``. Rows disagree about which slots hold real tokens, so a
boolean ``valid`` map (``[batch, num_slots]``) says which do, and every forward masks the others out:

- a sequence that joins is prefilled alone and its row is left-padded to the batch's slot count (invalid slots);
- a forward appends ``T`` slots to every row; row ``r`` feeds ``len(inputs[r])`` real tokens, the rest of its new
  slots are dummy tokens that only later dummies of the same row can see (causality), and that start invalid;
- after verification a row keeps its first ``n`` valid tokens (:meth:`RaggedCache.truncate`): the rejected draft
  slots become holes in the middle of the row, masked like padding;
- when holes and padding outgrow the real tokens, :meth:`RaggedCache.compact` gathers each row's valid slots to the
  right end of a shorter tensor (one ``gather`` per layer) so attention stops paying for them.

Worked example, two rows, one round with drafts of 2 and 0 tokens (``.`` = invalid slot)::

    before     row 0: . . a b     row 1: c d e f          (row 0 cached 2 tokens, row 1 four)
    forward    row 0: . . a b P x y   row 1: c d e f Q _ _   (P, Q pending tokens; _ dummies)
    keep 3, 5  row 0: . . a b P . .   row 1: c d e f Q . .   (row 0 kept P but rejected x, y)

A token's RoPE position is its row's count of valid tokens before it (``position_ids``), never its slot index, so
holes do not shift positions, and keys keep the rotation they got when they were written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError


def _layer_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per-layer (keys, values), or None while nothing has been written."""
    if not cache.layers or not cache.layers[0].is_initialized or cache.layers[0].keys.numel() == 0:
        return None
    return [(layer.keys, layer.values) for layer in cache.layers]


class RaggedCache:
    """A batch KV cache for one model; rows are named by sequence ids (``row_ids``)."""

    def __init__(self, lm: CausalLM) -> None:
        self.lm = lm
        self.cache = self._fresh_cache()
        if any(type(layer) is not DynamicLayer for layer in self.cache.layers):
            raise UnsupportedOptionError(
                f"batched decoding needs a model whose every layer uses full attention; '{lm.name}' has "
                "sliding-window or other special cache layers: use the single-sequence decoder")
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=lm.device)  # [batch, num_slots]
        self.row_ids: list[int] = []

    def _fresh_cache(self) -> DynamicCache:
        return DynamicCache(config=self.lm.model.config)

    @property
    def num_rows(self) -> int:
        return len(self.row_ids)

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    def lengths(self) -> list[int]:
        """Cached tokens per row."""
        return self.valid.sum(dim=1).tolist()

    def row(self, row_id: int) -> int:
        return self.row_ids.index(row_id)

    # -- rows joining and leaving -------------------------------------------------------------------------------

    @torch.inference_mode()
    def add(self, row_id: int, prefix_ids: list[int]) -> None:
        """Append a row holding ``prefix_ids`` (may be empty), prefilled alone: no padding in its own forward."""
        assert row_id not in self.row_ids, f"row {row_id} is already in the batch"
        cache = self._fresh_cache()
        if prefix_ids:
            ids = torch.tensor([prefix_ids], dtype=torch.long, device=self.lm.device)  # [1, n]
            # Clamped as forward() clamps: a draft model with a shorter window than its target's gets a prompt past it
            # (it drafts nothing there: batch/drafters.py), and learned positions have no row beyond it.
            positions = torch.arange(len(prefix_ids), device=self.lm.device).clamp_max(self.lm.max_context - 1)
            positions = positions.reshape(1, -1)
            cache = self.lm.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                                  logits_to_keep=1).past_key_values
        valid = torch.ones(1, len(prefix_ids), dtype=torch.bool, device=self.lm.device)  # [1, n]
        self._stack(cache, valid)
        self.row_ids.append(row_id)

    def _stack(self, cache: DynamicCache, valid: torch.Tensor) -> None:
        """Put the rows of ``cache`` below ours, left-padding whichever side has fewer slots."""
        num_slots = max(self.num_slots, valid.shape[1])
        mine, theirs = _layer_tensors(self.cache), _layer_tensors(cache)
        pad_mine, pad_theirs = num_slots - self.num_slots, num_slots - valid.shape[1]
        self.valid = torch.cat([F.pad(self.valid, (pad_mine, 0)), F.pad(valid, (pad_theirs, 0))], dim=0)
        if mine is None and theirs is None:
            return  # nothing written anywhere yet: the slot count is 0 on both sides
        template = mine if mine is not None else theirs

        def tensors(source, num_rows: int, pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            if source is None:  # rows with no slots yet: zero-length tensors shaped like the other side's
                source = [(k.new_zeros(num_rows, k.shape[1], 0, k.shape[3]),
                           v.new_zeros(num_rows, v.shape[1], 0, v.shape[3])) for k, v in template]
            # [rows, heads, slots, head_dim]: pad the slot dimension on the left.
            return [(F.pad(k, (0, 0, pad, 0)), F.pad(v, (0, 0, pad, 0))) for k, v in source]

        merged = zip(tensors(mine, self.valid.shape[0] - valid.shape[0], pad_mine),
                     tensors(theirs, valid.shape[0], pad_theirs))
        self._set([(torch.cat([k1, k2]), torch.cat([v1, v2])) for (k1, v1), (k2, v2) in merged])

    def _set(self, tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cache = self._fresh_cache()
        for layer, (keys, values) in zip(cache.layers, tensors):
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        self.cache = cache

    def remove(self, row_ids: set[int]) -> None:
        """Drop the rows of finished or cancelled sequences."""
        keep = [r for r, row_id in enumerate(self.row_ids) if row_id not in row_ids]
        if len(keep) == self.num_rows:
            return
        self.row_ids = [self.row_ids[r] for r in keep]
        if not keep:
            self.cache, self.valid = self._fresh_cache(), self.valid[:0, :0]
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.valid.device)
        self.valid = self.valid.index_select(0, index)
        tensors = _layer_tensors(self.cache)
        if tensors is not None:
            self._set([(k.index_select(0, index), v.index_select(0, index)) for k, v in tensors])
        self.compact_if_sparse()

    # -- decoding -----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, inputs: list[list[int]], pad_id: int = 0) -> torch.Tensor:
        """Feed ``inputs[r]`` (at least one token) after row ``r``'s cached tokens; all stay cached and valid.

        Returns float32 logits ``[batch, max_len, vocab]``; row ``r``'s entries past ``len(inputs[r])`` belong to
        dummy tokens and mean nothing.
        """
        assert len(inputs) == self.num_rows and all(inputs), "one non-empty input per row"
        device, dtype = self.lm.device, self.lm.dtype
        num_rows, width, num_slots = len(inputs), max(len(x) for x in inputs), self.num_slots
        ids = torch.full((num_rows, width), pad_id, dtype=torch.long)
        for r, row in enumerate(inputs):
            ids[r, :len(row)] = torch.tensor(row, dtype=torch.long)
        counts = torch.tensor([len(x) for x in inputs], device=device)  # [batch]
        lengths = self.valid.sum(dim=1)  # [batch]
        # Dummies may run past the context; clamp so learned position tables are never indexed out of range.
        positions = (lengths[:, None] + torch.arange(width, device=device)).clamp_max(self.lm.max_context - 1)
        mask = None  # no holes, no padding: the model's own causal path (and its fastest kernels)
        if not bool(self.valid.all()):
            causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # [width, width]
            visible = torch.cat([self.valid[:, None, :].expand(num_rows, width, num_slots),
                                 causal.expand(num_rows, width, width)], dim=2)  # [batch, width, slots + width]
            mask = torch.zeros(num_rows, 1, width, num_slots + width, dtype=dtype, device=device)
            mask.masked_fill_(~visible[:, None], torch.finfo(dtype).min)
        out = self.lm.model(input_ids=ids.to(device), position_ids=positions, attention_mask=mask,
                            past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        new_valid = torch.arange(width, device=device)[None, :] < counts[:, None]  # [batch, width]
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        return out.logits.float()

    def truncate(self, lengths: list[int]) -> None:
        """Keep the first ``lengths[r]`` valid tokens of row ``r``; the rest become holes."""
        keep = torch.tensor(lengths, device=self.valid.device)[:, None]  # [batch, 1]
        assert bool((self.valid.sum(dim=1, keepdim=True) >= keep).all()), "cannot keep more tokens than cached"
        self.valid = self.valid & (self.valid.cumsum(dim=1) <= keep)
        self.compact_if_sparse()

    def compact_if_sparse(self, min_waste: int = 32) -> None:
        """Compact once invalid slots reach ``min_waste`` and half the longest row: rare enough to be cheap."""
        longest = int(self.valid.sum(dim=1).max()) if self.num_rows else 0
        waste = self.num_slots - longest
        if waste >= min_waste and waste * 2 >= longest:
            self.compact()

    def compact(self) -> None:
        """Move each row's valid slots, in order, to the right end of a tensor as wide as the longest row."""
        tensors = _layer_tensors(self.cache)
        if tensors is None or not self.num_rows:
            return
        width = int(self.valid.sum(dim=1).max())
        # A stable sort of the 0/1 flags puts each row's invalid slots first, then its valid ones in slot order.
        order = torch.argsort(self.valid.to(torch.int8), dim=1, stable=True)[:, self.num_slots - width:]
        self.valid = self.valid.gather(1, order)  # [batch, width]

        def take(x: torch.Tensor) -> torch.Tensor:  # [batch, heads, slots, head_dim] -> [batch, heads, width, ...]
            return x.gather(2, order[:, None, :, None].expand(x.shape[0], x.shape[1], width, x.shape[3]))

        self._set([(take(k), take(v)) for k, v in tensors])
