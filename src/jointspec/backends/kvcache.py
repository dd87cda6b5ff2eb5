"""A KV cache that appends in place: what the torch adapter keeps its target's keys and values in.

transformers' ``DynamicCache`` appends a forward's new keys and values with ``torch.cat``, which copies every cached
entry of every layer on every forward; a speculative loop also crops the cache after each verification, so no
buffer is ever reused. :class:`BufferedCache` keeps each layer's keys and values in a buffer with room to spare:
a forward writes its new entries after the cached ones, a crop only shortens the view, and keeping the accepted
path of a tree moves only the entries after the first dropped one. Each layer's ``keys`` / ``values`` stay what
transformers expects (``[batch, kv_heads, length, head_dim]`` tensors, here views of the buffers), so attention and
masks run unchanged.

The buffers grow by doubling (at least ``MIN_CAPACITY`` entries), so a sequence of n tokens copies its cache
O(log n) times instead of n times. Where the most tokens a sequence will hold is known (``length``: the decode loop
knows its prompt and its ``max_new_tokens``), the first write takes that room at once: no copies, and no buffer up to
twice the size needed (each freed buffer also stayed in the C heap, as resident memory, until trimmed). A tree
verified at the sequence's end may briefly pass that room; the buffers then grow by a quarter. Anything that
replaces a layer's ``keys`` / ``values`` with other tensors (as transformers' own batch utilities do) is taken over
at the next append.

Hybrid models keep some layers' state in another form: LFM2's short convolutions keep their last few inputs,
Granite 4's and Qwen3.5's state-space and linear-attention layers a recurrent state as well (transformers'
linear-attention cache layers). A convolution's inputs can be taken back: the cache records them past each forward
(transformers' ``activate_past_recording``), as far back as ``ROLLBACK_ROOM`` tokens, and a crop drops the last
ones. A recurrent state cannot: it sums every token it has read. Only a copy taken before the tokens came
(:meth:`BufferedCache.recurrent_snapshot`) brings it back, and :meth:`BufferedCache.crop` refuses to take tokens out
of one without such a copy (:func:`recurrent_state_reason`); the adapter keeps the copies and reads again the tokens
after one that it keeps (backends/hf.py, :class:`~jointspec.backends.recurrent.StateHistory`).

A cache may store its entries in another dtype than the model computes in (``dtype``: float16 for a float32 model,
``--kv-cache float16``): half the memory and half the bytes each decoding step reads at long context. jointspec's
compiled layers read such buffers directly; anyone reading ``keys`` / ``values`` gets them widened to the model's
dtype (a copy, made at each read and not kept), so attention elsewhere runs unchanged on the values the cache holds.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

try:  # (transformers' linear-attention cache layers: hybrid models' convolutions and recurrent states)
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # an earlier transformers 5, whose hybrid models keep such state elsewhere
    class LinearAttentionCacheLayerMixin:  # noqa: D101 - nothing is ever one
        pass

from jointspec.core.errors import UnsupportedOptionError

MIN_CAPACITY = 256
# The tokens a crop may take back out of a convolution layer from its recorded inputs, kept that far back at least: a
# round's forward (the tokens read again after a crop, the pending one and up to 16 drafted) or a draft model's drafted
# tokens, one a forward. The adapter keeps more where a hybrid's oldest copy of its recurrent states is further back
# (a long draft). transformers' layers convolve every recorded input at each forward, so the room is paid for at every
# step; a crop further back reads the kept tokens again (backends/recurrent.py).
ROLLBACK_ROOM = 48


class BufferedLayer(DynamicLayer):
    """One attention layer's keys and values, stored in growing buffers (module docstring).

    ``keys`` / ``values`` are views of the buffers' first ``length`` entries, made when first read after the length
    changes: a forward that writes its entries itself (the compiled int4 layers) then only moves a count, and never
    pays for views nobody reads. Assigning either one (as transformers' own utilities may) hands the layer plain
    tensors again, which the next append copies into buffers."""

    _length: int | None = None  # None: keys / values are the plain tensors in _keys / _values

    def __init__(self, dtype: torch.dtype | None = None, length: int | None = None) -> None:
        super().__init__()
        self.storage_dtype = dtype  # None: as the keys and values come
        self.expected_length = length or 0  # the room a first write takes (0: grow as needed)

    def _view(self, buffer: torch.Tensor, kept: str) -> torch.Tensor:
        """The first ``length`` entries of ``buffer``, in the dtype the model computes in (the module docstring).
        A view of buffers in that dtype is kept (attribute ``kept``) until the length changes; a widened copy of
        buffers in another dtype is made at each read and not kept: kept, every layer's copy would stay alive until
        that layer's next forward, a second cache at the model's width beside the stored one."""
        view = getattr(self, kept)
        if view is None:
            view = buffer[..., :self._length, :]
            if view.dtype != self._compute_dtype:
                return view.to(self._compute_dtype)
            setattr(self, kept, view)
        return view

    def get_seq_length(self) -> int:
        # The count, without reading (and so widening) the entries as transformers' own does.
        return self._length if self._length is not None else super().get_seq_length()

    @property
    def keys(self) -> torch.Tensor | None:
        if self._length is None:
            return self._keys
        return self._view(self._key_buffer, "_key_view")

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._detach()
        self._keys = value

    @property
    def values(self) -> torch.Tensor | None:
        if self._length is None:
            return self._values
        return self._view(self._value_buffer, "_value_view")

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._detach()
        self._values = value

    def _detach(self) -> None:
        """Turn the buffer views into plain tensors (before one of them is replaced from outside)."""
        if self._length is not None:
            self._keys, self._values = self.keys, self.values
            self._length = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = self._value_buffer = None  # [batch, kv_heads, capacity, head_dim]
        self._compute_dtype = key_states.dtype

    def _adopt(self) -> int:
        """The cached length, taking over ``keys`` / ``values`` into fresh buffers if something replaced them."""
        if self._length is not None:
            return self._length
        length = self._keys.shape[-2] if self._keys.dim() == 4 else 0
        keys, values = self._keys, self._values
        self._key_buffer = self._value_buffer = None
        if length:
            self._reserve(keys, values, length)
            self._key_buffer[..., :length, :] = keys
            self._value_buffer[..., :length, :] = values
            self._set_length(length)
        return length

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, needed: int) -> None:
        """Room for ``needed`` entries shaped like ``keys`` / ``values``, keeping the cached ones."""
        capacity = 0 if self._key_buffer is None else self._key_buffer.shape[-2]
        if needed <= capacity:
            return
        if needed <= self.expected_length:
            capacity = self.expected_length
        elif self.expected_length:
            # Past the expected room (a verified tree's nodes, kept for a moment, can pass the sequence's last
            # position): a quarter more, not twice what the sequence needs.
            capacity = max(needed, capacity + capacity // 4, capacity + MIN_CAPACITY)
        else:
            capacity = max(needed, 2 * capacity, MIN_CAPACITY)
        old = (self._key_buffer, self._value_buffer)
        self._key_buffer = keys.new_empty(keys.shape[:-2] + (capacity, keys.shape[-1]),
                                          dtype=self.storage_dtype or keys.dtype)
        self._value_buffer = values.new_empty(values.shape[:-2] + (capacity, values.shape[-1]),
                                              dtype=self.storage_dtype or values.dtype)
        if old[0] is not None:
            length = self._length or 0
            self._key_buffer[..., :length, :] = old[0][..., :length, :]
            self._value_buffer[..., :length, :] = old[1][..., :length, :]

    def _set_length(self, length: int) -> None:
        self._length = length
        self._key_view = self._value_view = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self._adopt()
        end = start + key_states.shape[-2]
        self._reserve(key_states, value_states, end)
        self._key_buffer[..., start:end, :] = key_states
        self._value_buffer[..., start:end, :] = value_states
        self._set_length(end)
        return self.keys, self.values

    def append_slots(self, count: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Make room for ``count`` entries that the caller writes itself (a compiled layer does): returns the key and
        value buffers ([batch, kv_heads, capacity, head_dim]) and the index of the first new entry; the cache counts
        the new entries from now on. ``like`` ([batch, kv_heads, any, head_dim]) gives the shape, dtype and device."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        start = self._adopt()
        self._reserve(like, like, start + count)
        self._set_length(start + count)
        return self._key_buffer, self._value_buffer, start

    _rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (key buffer, its row 0, value row 0)

    def append_rows(self, count: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """:meth:`append_slots` for a batch of one, as the compiled layers take it: the key and value buffers' only
        batch row ([kv_heads, capacity, head_dim]) and the index of the first new entry. The row views are kept
        until the buffers grow, so a caller may tell a changed buffer by identity (and each step makes no views)."""
        key_buffer, value_buffer, start = self.append_slots(count, like)
        rows = self._rows
        if rows is None or rows[0] is not key_buffer:
            rows = self._rows = (key_buffer, key_buffer[0], value_buffer[0])
        return rows[1], rows[2], start

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` entries (transformers >= 5 passes a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the number of tokens to remove as a negative count, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        length = self._adopt()
        self._set_length(max(0, length + tokens_to_remove))

    def keep(self, positions: torch.Tensor) -> None:
        """Keep the entries at ``positions`` (increasing), in that order. Entries before the first position that
        moves stay where they are; only the rest are gathered."""
        if not self.is_initialized:
            return
        self._adopt()
        moved = (positions != torch.arange(len(positions), device=positions.device)).nonzero()
        if len(moved):
            first = int(moved[0])
            tail = positions[first:]
            # index_select makes a separate tensor, so the write cannot read entries it has already overwritten.
            self._key_buffer[..., first:len(positions), :] = self._key_buffer.index_select(-2, tail)
            self._value_buffer[..., first:len(positions), :] = self._value_buffer.index_select(-2, tail)
        self._set_length(len(positions))


def sliding_window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[rows, keys] bool: which keys a sliding-window layer's rows may see, by position: the last ``window``
    positions up to the row's own, as transformers' sliding masks give a chain (``kv > q - window``). By position
    rather than cache slot, so a tree node sees what it will see once its path is kept and decoded token by token."""
    return key_positions[None, :] > query_positions[:, None] - window


class BufferedSlidingLayer(BufferedLayer):
    """A sliding-window layer kept whole: every entry stays, as in a full-attention layer, and the attention mask
    applies the window. transformers' masks do that for a layer that says it slides (``is_sliding``) and reports its
    whole length (``get_mask_sizes``, as :class:`BufferedLayer` does); tree masks made by the adapter apply it
    themselves (:func:`sliding_window_mask`).

    transformers' own ``DynamicSlidingWindowLayer`` keeps only the last ``sliding_window - 1`` entries, so once a
    sequence passes the window its cache can no longer be cropped back, and a speculative loop crops after every
    verification (Gemma-3, whose layers mostly slide, failed there after 512 tokens). Keeping every entry costs the
    memory of a full-attention layer, as llama.cpp's default full-size cache for such models does."""

    is_sliding = True

    def __init__(self, dtype: torch.dtype | None, sliding_window: int, length: int | None = None) -> None:
        super().__init__(dtype, length)
        self.sliding_window = sliding_window


class BufferedCache(DynamicCache):
    """``DynamicCache`` whose layers are :class:`BufferedLayer` (full attention) and :class:`BufferedSlidingLayer`
    (sliding windows), storing their entries in ``dtype`` (None: as they come), with room for ``length`` entries
    taken at their first write (None: grown as needed)."""

    def __init__(self, config, dtype: torch.dtype | None = None, length: int | None = None) -> None:
        super().__init__(config=config)
        self.layers = [BufferedLayer(dtype, length) if type(layer) is DynamicLayer
                       else BufferedSlidingLayer(dtype, layer.sliding_window, length)
                       if type(layer) is DynamicSlidingWindowLayer else layer for layer in self.layers]
        self.convolutions = [layer for layer in self.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        for layer in self.convolutions:  # (their inputs kept past each forward, until a crop cuts them back)
            layer.activate_past_recording()

    def crop(self, tokens_to_remove: int, *, states: list[torch.Tensor] | None = None) -> None:
        """Take the last ``-tokens_to_remove`` tokens out of every layer (transformers' negative count; 0: none).
        ``states``: the recurrent states as they were before those tokens (a :meth:`recurrent_snapshot` taken then),
        put back; without them, UnsupportedOptionError where a layer holds a recurrent state, which no crop can take
        tokens out of (a convolution's recorded inputs are checked by the adapter, which knows the sequence's length:
        :meth:`records_back`)."""
        if tokens_to_remove < 0 and states is None:
            reason = recurrent_state_reason(self)
            if reason:
                raise UnsupportedOptionError(f"cannot take {-tokens_to_remove} tokens back out of this cache: "
                                             f"{reason}")
        if states is not None:
            for state, saved in zip(self.recurrent_states(), states, strict=True):
                state.copy_(saved)  # (in place: the layers hand this tensor to the next forward)
        for layer in self.layers:
            if not isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.crop(tokens_to_remove)
            elif tokens_to_remove < 0:  # (the last inputs dropped, the earlier ones kept for a later crop: not
                # transformers' crop, which keeps the kernel's width alone)
                for index, initialized in layer.is_conv_states_initialized.items():
                    if initialized:
                        layer.conv_states[index] = layer.conv_states[index][..., :tokens_to_remove]
                if isinstance(layer, DynamicLayer):  # (Falcon-H1's: attention beside the state-space mixer, whose
                    # keys and values are the next class's in the layer's order: DynamicLayer's or the sliding one's)
                    super(LinearAttentionCacheLayerMixin, layer).crop(tokens_to_remove)

    def recurrent_states(self) -> list[torch.Tensor]:
        """Every recurrent state the layers hold, in the layers' order (each layer's in its own)."""
        return [layer.recurrent_states[index] for layer in self.convolutions
                for index, initialized in layer.is_recurrent_states_initialized.items() if initialized]

    @torch.inference_mode()
    def recurrent_snapshot(self, into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """A copy of every recurrent state as it is now (empty where there are none yet): what :meth:`crop` puts
        back to take later tokens out. ``into``: an earlier copy of this cache's, written over."""
        states = self.recurrent_states()
        if into is None or len(into) != len(states):
            return [state.clone() for state in states]
        for saved, state in zip(into, states):
            saved.copy_(state)
        return into

    def keep_recent(self, count: int = ROLLBACK_ROOM) -> None:
        """Cut each convolution's recorded inputs back to what taking the last ``count`` tokens out would need: its
        width plus ``count`` (a long prompt's forward would otherwise keep every input it read until the next crop)."""
        for layer in self.convolutions:
            for index, initialized in layer.is_conv_states_initialized.items():
                if initialized:
                    layer.conv_states[index] = layer.conv_states[index][..., -(layer.conv_kernel_size[index] + count):]

    def records_back(self, count: int, kept: int) -> bool:
        """Whether the convolutions can give back their last ``count`` tokens, ``kept`` tokens staying before them:
        every layer has recorded those tokens' inputs and the kernel's width before them (or all the kept ones, where
        fewer)."""
        return all(layer.conv_states[index].shape[-1] >= count + min(layer.conv_kernel_size[index], kept)
                   for layer in self.convolutions
                   for index, initialized in layer.is_conv_states_initialized.items() if initialized)

    @property
    def sliding_window(self) -> int | None:
        """The window of the layers that slide (None: none does)."""
        return next((layer.sliding_window for layer in self.layers if isinstance(layer, BufferedSlidingLayer)), None)

    def append_rows(self, count: int, like: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """Every layer's :meth:`BufferedLayer.append_rows` (all layers :class:`BufferedLayer`): their key rows,
        value rows, and the index of the first new entry, which all layers share. The common case (room in buffers
        already taken over) is done here for every layer, without a call per layer: the compiled layers ask this of
        every sequence at every step."""
        keys, values, start = [], [], None
        for layer in self.layers:
            length, rows = layer._length, layer._rows
            if (length is not None and rows is not None and rows[0] is layer._key_buffer
                    and length + count <= rows[1].shape[1]):
                layer._length = length + count
                layer._key_view = layer._value_view = None
                key_rows, value_rows = rows[1], rows[2]
            else:
                key_rows, value_rows, length = layer.append_rows(count, like)
            if start is None:
                start = length
            elif length != start:
                raise AssertionError(f"the layers' caches hold different lengths ({start} and {length})")
            keys.append(key_rows)
            values.append(value_rows)
        return keys, values, start

    @torch.inference_mode()
    def fit(self) -> None:
        """Give back the room past the cached entries in every buffered layer (a cache kept for later holds its
        capacity as memory no entry uses; a later append grows it again)."""
        for layer in self.layers:
            if (isinstance(layer, BufferedLayer) and layer._length is not None and layer._key_buffer is not None
                    and layer._key_buffer.shape[-2] > layer._length):
                length = layer._length
                layer._key_buffer = layer._key_buffer[..., :length, :].clone()
                layer._value_buffer = layer._value_buffer[..., :length, :].clone()
                layer._rows = None
                layer._set_length(length)

    @torch.inference_mode()  # the buffers are inference tensors (the adapter's forward makes them)
    def keep(self, positions: torch.Tensor) -> None:
        """Keep the cached entries at ``positions`` (increasing) in every layer, in that order."""
        if self.convolutions:  # (a tree's branches would each need their own state: the adapter drafts no trees)
            raise UnsupportedOptionError("a hybrid model's convolution or recurrent layers hold one path: only a "
                                         "prefix of the cached tokens can be kept")
        for layer in self.layers:
            if isinstance(layer, BufferedLayer):
                layer.keep(positions)
            elif layer.keys is not None:  # (not a layer that holds none: Gemma 3n's that read another's entries)
                layer.keys = layer.keys.index_select(-2, positions)
                layer.values = layer.values.index_select(-2, positions)


def recurrent_state_reason(cache: DynamicCache) -> str:
    """Why tokens cannot be taken back out of ``cache`` ("" where they can): a layer holds a recurrent state (a
    state-space or linear-attention layer's), which sums every token it has read."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin) and any(layer.is_recurrent_states_initialized.values()):
            return ("its state-space or linear-attention layers keep a recurrent state, which holds every token it "
                    "has read")
    return ""
