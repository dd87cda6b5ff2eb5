"""One causal LM and the KV cache of one sequence.

The adapter is the only place that calls a Hugging Face model. It knows how many tokens are in its cache
(``num_cached``), feeds new tokens after them, and rolls the cache back to exactly the tokens the loop kept.

New tokens can form a *tree*: ``parents[i]`` names the input that token ``i`` follows (``-1``: the last cached
token). Each token then sees the whole cache plus its own ancestors, and sits at position
``num_cached + depth``, so every branch is scored as if it were run alone. A chain is the tree
``parents = [-1, 0, 1, ...]`` and takes the model's ordinary causal path.
"""

from __future__ import annotations

import inspect
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from jointspec.backends.kvcache import ROLLBACK_ROOM, BufferedCache, recurrent_state_reason, sliding_window_mask
from jointspec.backends.lean_forward import (
    LeanCall,
    LeanLlamaForward,
    attention_mass,
    lean_forward_for,
    transformers_forward,
)
from jointspec.backends.lean_gemma import lean_gemma_for
from jointspec.backends.lean_qwen3 import lean_qwen3_for
from jointspec.backends.recurrent import StateHistory, install_short_chain_forms, states_after
from jointspec.core.draft import chain_parents, tree_depths
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.sampling import RowDraws
from jointspec.core.target import ForwardCall, ForwardOutput, TargetCapabilities, TargetLM
from jointspec.kernels.heap import release_freed_memory

log = logging.getLogger(__name__)

# A prompt prefill longer than this runs in chunks of this many tokens: the attention of a chunk then needs no mask
# over the whole prompt (transformers' mask at 7k tokens is 196 MB), peak memory stays bounded, and a caller can show
# progress. The loop prefills the same way for every method, so chunking changes nothing between them. A model on
# jointspec's compiled layers reads in its own, smaller chunks (LeanLlamaForward.prefill_chunk).
PREFILL_CHUNK = 1024


# The model types whose lean forwards never read a screened head (LeanGemmaForward and LeanQwen3Forward's
# ``screens_head``): their loads skip building one (backends/loading.py).
EXACT_HEAD_MODEL_TYPES = ("gemma3", "gemma3_text", "qwen3")


def lean_forward_of(model: PreTrainedModel) -> LeanLlamaForward | None:
    """The lean forward ``model`` takes: Llama's (Llama, Mistral, Qwen2), Gemma-3's or Qwen3's where its layers run
    on jointspec's compiled ones, else None (transformers' own forward)."""
    return lean_gemma_for(model) or lean_qwen3_for(model) or lean_forward_for(model)


def tree_ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


class FeatureMirror:
    """The target's features (last hidden states after the final norm) of exactly the tokens in its cache.

    ``layers``: which of the target's hidden states each row holds, side by side (-1, the last after the final norm,
    by default; a head that fuses several layers asks for more, see :mod:`jointspec.drafts.eagle`).

    Feature-level draft heads (:mod:`jointspec.drafts.eagle`) read it. The adapter keeps it in step with its cache:
    rows are appended by every forward and dropped or gathered by ``crop``/``keep``/``reset``. Storage grows by
    doubling, so appending a round's rows does not copy the whole history.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 layers: tuple[int, ...] = (-1,)) -> None:
        self.layers = tuple(layers)
        self._buffer = torch.zeros(256, hidden_size * len(self.layers), dtype=dtype, device=device)  # [capacity, width]
        self.length = 0
        self.synced = False  # a mirror attached mid-sequence stays empty until the adapter's next reset

    @property
    def features(self) -> torch.Tensor:
        return self._buffer[:self.length]  # [length, hidden]

    # In-place updates run in inference mode: a buffer grown inside a forward (inference mode) is an inference tensor,
    # which torch lets no one update in place outside it (tree verification calls keep() outside).
    @torch.inference_mode()
    def append(self, rows: torch.Tensor) -> None:
        end = self.length + rows.shape[0]
        if end > self._buffer.shape[0]:
            grown = torch.zeros(max(end, 2 * self._buffer.shape[0]), self._buffer.shape[1],
                                dtype=self._buffer.dtype, device=self._buffer.device)
            grown[:self.length] = self.features
            self._buffer = grown
        self._buffer[self.length:end] = rows
        self.length = end

    def crop(self, length: int) -> None:
        self.length = min(length, self.length)

    @torch.inference_mode()
    def keep(self, index: torch.Tensor) -> None:
        kept = self.features.index_select(0, index)
        self._buffer[:kept.shape[0]] = kept
        self.length = kept.shape[0]


@dataclass(frozen=True)
class CacheKinds:
    """What a model's cache layers allow besides keys and values: ``chains``, why it scores chains only (its
    convolution or recurrent layers keep one state, which a tree's branches cannot share; "": it scores trees);
    ``recurrent``, why no draft can be taken back out of it (a layer keeps a recurrent state, which every token it
    reads changes for good; "": one can)."""

    chains: str = ""
    recurrent: str = ""


# Each model's, found once (cache_kinds): a hybrid's takes a forward of one token.
_CACHE_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.inference_mode()
def cache_kinds(model: PreTrainedModel) -> CacheKinds:
    """What ``model``'s cache allows (:class:`CacheKinds`). transformers makes a hybrid's recurrent states (Granite
    4's and Falcon-H1's state-space layers, Qwen3.5's and Qwen3-Next's linear attention) at a layer's first forward,
    so a model with linear-attention cache layers is read once, one token on a cache of its own. UnsupportedOptionError
    where the model keeps its state where jointspec's cache cannot hold it: in an argument of its own (Mamba's
    ``cache_params``, RWKV's ``state``), on its modules (RecurrentGemma's), or in a cache transformers will not mix
    with another (MiniMax's)."""
    if model in _CACHE_KINDS:
        return _CACHE_KINDS[model]
    kind = getattr(model.config, "model_type", "") or "this model"
    arguments = inspect.signature(model.forward).parameters
    own = [name for name in ("cache_params", "state") if name in arguments]
    if own and "past_key_values" not in arguments:
        raise UnsupportedOptionError(f"{kind} keeps its state in an argument of its own ({own[0]}), not in "
                                     "transformers' cache, which jointspec decodes with: it cannot decode this model")
    probe = BufferedCache(model.config)
    kinds = CacheKinds()
    if probe.convolutions:
        start = getattr(model.config, "bos_token_id", None)
        token = torch.tensor([[start if isinstance(start, int) else 0]], device=model.device)
        try:
            model(input_ids=token, past_key_values=probe, use_cache=True)
        except (ValueError, TypeError) as error:
            raise UnsupportedOptionError(f"{kind}: transformers refuses jointspec's cache for it ({error}): it "
                                         "cannot decode this model") from None
        if any(not any(layer.is_conv_states_initialized.values())
               and not any(layer.is_recurrent_states_initialized.values()) for layer in probe.convolutions):
            raise UnsupportedOptionError(f"{kind} keeps some layers' state outside transformers' cache (on its own "
                                         "modules), which jointspec decodes with: it cannot decode this model")
        reason = recurrent_state_reason(probe)
        if reason and _reads_chains_without_state(model, token, probe):
            raise UnsupportedOptionError(f"{kind}: transformers' recurrent layers for it read a forward of several "
                                         "tokens without the state before it, so a prompt read in chunks or a "
                                         "verified draft would come out wrong: it cannot decode this model")
        kinds = CacheKinds(f"{kind}'s convolution or recurrent layers keep one state, which a tree's branches cannot "
                           "share", f"{kind}: {reason}" if reason else "")
    _CACHE_KINDS[model] = kinds
    return kinds


def _reads_chains_without_state(model: PreTrainedModel, token: torch.Tensor, probe: BufferedCache) -> bool:
    """Whether ``model`` reads a forward of several tokens after a cached state as if no state came before (Jamba's
    Mamba layers in transformers start such a scan from zero): two tokens read after ``probe`` (which holds ``token``)
    come out bit for bit the same when its recurrent states are moved. A layer that reads its state cannot give the
    same bits from another one, however little the state weighs in its output (a tolerance cannot tell that apart:
    Jamba's states, as initialised, move its logits less than a correct model's chunks round them)."""
    moved = BufferedCache(model.config)
    model(input_ids=token, past_key_values=moved, use_cache=True)
    for state in moved.recurrent_states():
        state.add_(1.0)
    more = (token + torch.tensor([[1, 2]], device=model.device)) % model.get_input_embeddings().num_embeddings
    after = model(input_ids=more, past_key_values=probe, use_cache=True).logits
    return torch.equal(after, model(input_ids=more, past_key_values=moved, use_cache=True).logits)


def slot_position_reason(config) -> str | None:
    """Why a model's attention depends on where each key sits in the cache, not on its position id (None: it does
    not). ALiBi (Bloom, MPT, Falcon with ``alibi``) biases each key by its distance in cache slots, and GPT-Neo's local
    layers take their window over slots. Such a model's rows are exact only where slot and position agree: a chain
    appended after the committed tokens. A tree's nodes (at slots past their depth), a view of part of the cache and a
    batch's cache with the holes a rejected draft leaves are not, so their methods and engines refuse it."""
    kind = getattr(config, "model_type", "")
    attn = getattr(config, "attn_config", None)  # MPT's (ALiBi unless it says otherwise)
    mpt_alibi = attn.get("alibi", True) if isinstance(attn, dict) else getattr(attn, "alibi", True)
    if kind == "bloom" or (kind == "mpt" and mpt_alibi) or getattr(config, "alibi", False) is True:
        return f"{kind or 'this model'}'s ALiBi attention biases keys by their place in the cache"
    if "local" in (getattr(config, "attention_layers", None) or ()):
        return f"{kind or 'this model'}'s local attention windows count places in the cache"
    return None


class CausalLM:
    """A Hugging Face causal LM plus one sequence's KV cache.

    ``lean``: run transformers' Llama models through :mod:`jointspec.backends.lean_forward` (the same operations, bit
    for bit, without transformers' per-module overhead); other models, and ``lean=False``, run transformers' forward.
    ``kv_dtype``: what the cache stores keys and values in (None: the model's dtype); float16 needs jointspec's
    compiled CPU layers (:meth:`check_kv_dtype`).
    """

    def __init__(self, model: PreTrainedModel, name: str = "model", *, lean: bool = True,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model.eval()
        self.name = name
        self.lean = lean_forward_of(self.model) if lean else None
        self.kv_dtype = kv_dtype
        self.check_kv_dtype()
        if cache_kinds(self.model).recurrent:  # (refuses a model whose state its cache cannot hold)
            install_short_chain_forms(self.model)  # (a verification's rows as plain decoding's, and cheaper)
        self.cache = BufferedCache(model.config, kv_dtype)
        self.num_cached = 0
        self.states = self._state_history()
        self._replayed = 0  # the tokens read again at the start of the forward in flight (backends/recurrent.py)
        self._ran = False  # whether the forward in flight has called the model (a hybrid's, see forward)
        self.mirrors: list[FeatureMirror] = []
        # Called as (tokens done, tokens in all) after each chunk of a long prefill (see prefill_chunk).
        self.prefill_progress: Callable[[int, int], None] | None = None

    def attach_feature_mirror(self, layers: tuple[int, ...] = (-1,)) -> FeatureMirror:
        """Start recording this adapter's features (its hidden states at ``layers``, see :class:`FeatureMirror`);
        the mirror is in step with the cache from the next ``reset``."""
        bad = [layer for layer in layers if not -1 <= layer < self.model.config.num_hidden_layers]
        if bad:
            raise UnsupportedOptionError(f"this target has {self.model.config.num_hidden_layers} decoder layers; "
                                         f"hidden-state indices {bad} do not exist")
        mirror = FeatureMirror(self.model.config.hidden_size, self.dtype, self.device, layers)
        mirror.synced = self.num_cached == 0
        self.mirrors.append(mirror)
        return mirror

    def detach_feature_mirror(self, mirror: FeatureMirror) -> None:
        """Stop recording into ``mirror`` (a draft that will not be used): every forward stops paying for it."""
        self.mirrors = [other for other in self.mirrors if other is not mirror]

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def capabilities(self) -> TargetCapabilities:
        # The screen is read each time: quantising the model in place can give it a screened head after construction.
        from jointspec.kernels.grouped import ROWWISE_MAX_ROWS, SCREEN_TOP_K_MAX

        head = self.model.get_output_embeddings()
        screens = self.lean is not None and self.lean.screens_head
        kinds = cache_kinds(self.model)
        by_slot = slot_position_reason(self.model.config) or kinds.chains or None
        return TargetCapabilities(trees=by_slot is None, features=True, fork=True, torch_module=True,
                                  sparse_view=by_slot is None, chains_only=by_slot or "",
                                  argmax_screen=screens and hasattr(head, "argmax_logits"),
                                  top_k_screen=SCREEN_TOP_K_MAX if screens and hasattr(head, "top_k_logits") else 0,
                                  draw_screen=screens and hasattr(head, "draw_tokens"),
                                  screen_masks=screens and hasattr(head, "argmax_logits"),
                                  # CPU forwards past it take the prompt's one-call kernels (kernels/grouped.py)
                                  max_verify_rows=ROWWISE_MAX_ROWS if self.device.type == "cpu" else None)

    def check_kv_dtype(self) -> None:
        """Raise :class:`UnsupportedOptionError` unless this adapter can keep its cache in ``kv_dtype``: the model's
        own dtype anywhere; float16 for a float32 model on jointspec's compiled CPU layers, whose attention reads the
        half entries directly (elsewhere every step would widen the whole cache again)."""
        if self.kv_dtype in (None, self.model.dtype):
            return
        if self.kv_dtype != torch.float16 or self.model.dtype != torch.float32:
            raise UnsupportedOptionError(f"a {str(self.kv_dtype).removeprefix('torch.')} cache for a "
                                         f"{str(self.model.dtype).removeprefix('torch.')} model is not supported; "
                                         "the cache can be float32 or, for a float32 model, float16")
        if self.lean is None or self.lean.compiled is None:
            raise UnsupportedOptionError("a float16 KV cache needs jointspec's compiled CPU layers (a model quantised "
                                         "with --quantize int4 or auto on a CPU; --quantize int8 runs PyTorch's int8 "
                                         "kernel); this model runs transformers' forward: use --kv-cache auto")

    def fork(self, name: str | None = None, *, kv_dtype: torch.dtype | None = None) -> CausalLM:
        """A second adapter over the same weights, with its own empty cache (a self-draft, a cost probe), stored in
        ``kv_dtype`` (None: this adapter's)."""
        fork = CausalLM(self.model, name=name or f"{self.name} (fork)", lean=False)
        # The same lean forward (it keeps no sequence state): cheap to fork, and forward_many can run both together.
        fork.lean = self.lean
        fork.kv_dtype = self.kv_dtype if kv_dtype is None else kv_dtype
        fork.check_kv_dtype()
        fork.reset()
        return fork

    def reset(self, *, plain: bool = False, length: int | None = None) -> None:
        """Empty the cache for a new sequence. ``plain`` (this decode verifies nothing) changes nothing here: torch
        runs the same kernels either way; the llama.cpp adapter keeps faster ones for such decodes. ``length``: the
        most tokens the sequence will hold, where known; each layer's buffers then take that room at their first
        write, instead of growing (and copying) as the sequence does."""
        self.cache = BufferedCache(self.model.config, self.kv_dtype, length=length)
        self.num_cached = 0
        self.states = self._state_history(plain, length)
        for mirror in self.mirrors:
            mirror.crop(0)
            mirror.synced = True

    def _state_history(self, plain: bool = False, length: int | None = None) -> StateHistory | None:
        """Where the model has convolution or recurrent layers (a hybrid), what takes drafts back out of them."""
        kinds = cache_kinds(self.model)
        return StateHistory(plain, length, recurrent=bool(kinds.recurrent)) if kinds.chains else None

    @torch.inference_mode()
    def forward(self, token_ids: list[int] | torch.Tensor, *, parents: list[int] | None = None,
                num_logits: int | None = None, output_hidden: bool = False,
                argmax_only: bool = False, top_k_only: int = 0,
                attend_to: torch.Tensor | None = None, draws: RowDraws | None = None,
                allowed: torch.Tensor | None = None) -> ForwardOutput:
        """Feed ``token_ids`` after the cache; they stay cached. Returns the last ``num_logits`` rows (all if None).

        ``parents`` (optional) makes the new tokens a tree, see the module docstring. ``argmax_only``: the caller
        reads only each row's argmax (greedy verification), so a target with an argmax screen may return
        logits whose other entries are approximate (``capabilities.argmax_screen``; kernels/grouped.py);
        ``top_k_only`` = k > 0: it reads only each row's k largest logits (sampling with top-k), likewise
        (``capabilities.top_k_screen``). ``draws``: each row's token drawn through the screened head instead, the rows
        returned one-hot at the draws (``capabilities.draw_screen``; core/sampling.py). ``allowed`` (bool [rows,
        vocab]; ``capabilities.screen_masks``): the screens find each row's best among its allowed tokens.
        A prefill (``num_logits=0``, a chain) longer than a chunk runs in the chunks :meth:`prefill_chunk_end` gives
        (``prefill_chunk`` tokens; on the AVX2 builds, 128 over a prompt's first positions).
        ``attend_to`` (int64 positions below ``num_cached``, increasing): the only cached tokens the new ones see
        (they still see each other causally, or along ``parents``); None: all of them.
        """
        if self.states is None:
            return self._forward(token_ids, parents, num_logits, output_hidden, argmax_only, top_k_only, attend_to,
                                 draws, allowed)
        history = self.states
        before = (len(history.tokens), list(history.replay), self.num_cached)
        self._ran = False
        try:
            token_ids, parents, num_logits = self._with_replay(token_ids, parents, num_logits)
            return self._forward(token_ids, parents, num_logits, output_hidden, argmax_only, top_k_only, attend_to,
                                 draws, allowed)
        except Exception:
            # The counts as they were. A model that failed before it ran (a bad token) left the cache as it was; one
            # that failed as it ran may have changed some layers: the kept tokens are then all read again.
            del history.tokens[before[0]:]
            history.replay, self.num_cached, self._replayed = before[1], before[2], 0
            if self._ran:
                self.cache = BufferedCache(self.model.config, self.kv_dtype, length=history.length)
                history.snapshots.clear()
                history.replay = list(history.tokens)
            raise

    def _forward(self, token_ids, parents, num_logits, output_hidden, argmax_only, top_k_only, attend_to, draws,
                 allowed) -> ForwardOutput:
        if (num_logits == 0 and parents is None and attend_to is None
                and self.prefill_chunk_end(self.num_cached, self.num_cached + len(token_ids))
                < self.num_cached + len(token_ids)):
            return self._prefill_in_chunks(token_ids, output_hidden)
        call = self._lean_call(token_ids, parents, num_logits, output_hidden, argmax_only, attend_to, top_k_only,
                               draws, allowed)
        history, start = self.states, self.num_cached
        # A forward that reads kept tokens again before its own has its recurrent layers hand back their states
        # between the two: the copy the next crop goes back to (backends/recurrent.py).
        split = (self._replayed if history is not None and history.recurrent and not history.plain
                 and 0 < self._replayed < call.input_ids.shape[1] else 0)
        if history is not None:
            history.before_forward(self.cache, start)
        self._ran = True  # (from here a failure may leave the cache changed: forward() then reads it all again)
        with states_after(split) as middle:
            if self.lean is not None:
                extra = {"draws": draws} if draws is not None else {}
                if allowed is not None:
                    extra["allowed"] = allowed
                logits, states = self.lean(call.input_ids, call.position_ids, call.attention_mask, self.cache,
                                           call.num_logits, call.hidden_layers, argmax_only=argmax_only,
                                           top_k_only=top_k_only, **extra)
            else:
                logits, states = transformers_forward(self.model, call.input_ids, call.position_ids,
                                                      call.attention_mask, self.cache, call.num_logits,
                                                      call.hidden_layers)
        if middle:
            history.add(start + split, middle, self.cache)
        return self._finish(call, output_hidden, logits, states)

    def _with_replay(self, token_ids, parents, num_logits) -> tuple[list[int], None, int | None]:
        """A hybrid model's forward: ``token_ids`` counted among its tokens, and after a crop the tokens it must
        read again put before them, their rows left out of the output (backends/recurrent.py)."""
        token_ids = torch.as_tensor(token_ids).reshape(-1).tolist()
        if not token_ids:
            raise ValueError("forward needs at least one token")
        vocab = self.model.get_input_embeddings().num_embeddings
        bad = next((token for token in token_ids if not 0 <= token < vocab), None)
        if bad is not None:  # (before anything is counted or read)
            raise ValueError(f"token id {bad} is outside the model's vocabulary (0 to {vocab - 1})")
        if parents is not None and parents != chain_parents(len(token_ids)):
            raise UnsupportedOptionError(f"target '{self.name}' scores chains only ({cache_kinds(self.model).chains})")
        history = self.states
        history.tokens.extend(token_ids)
        replay, history.replay = history.replay, []
        if not replay:
            return token_ids, None, num_logits
        self.num_cached -= len(replay)  # (the cache's own count until the forward adds them)
        self._replayed = len(replay)
        if len(replay) > self.prefill_chunk:  # (read from the start again: as a prompt, in its chunks)
            self._forward(replay, None, 0, False, False, 0, None, None, None)
            replay = []
        return replay + token_ids, None, len(token_ids) if num_logits is None else num_logits

    def _prefill_in_chunks(self, token_ids: list[int] | torch.Tensor, output_hidden: bool) -> ForwardOutput:
        # Chunks by position in the sequence (prefill_chunk_end), as the batched engine reads a prompt after a kept
        # cache's entries.
        first = self.num_cached
        total = first + len(token_ids)
        start = first
        while start < total:
            stop = self.prefill_chunk_end(start, total)
            out = self._forward(token_ids[start - first:stop - first], None, 0, output_hidden, False, 0, None, None,
                                None)
            # A chunk's activations, attention scores and dequantised weights are tens of megabytes each, freed
            # into the C heap, which keeps them as resident memory; handed back, the next chunk's peak starts lower.
            release_freed_memory()
            if self.prefill_progress is not None:
                self.prefill_progress(stop - first, total - first)
            start = stop
        return out

    @property
    def prefill_chunk(self) -> int:
        """The tokens of a prompt read per forward: :data:`PREFILL_CHUNK`, or the lean forward's own chunk where
        that is smaller."""
        own = self.lean.prefill_chunk if self.lean is not None else None
        return min(own or PREFILL_CHUNK, PREFILL_CHUNK)

    def prefill_chunk_end(self, start: int, total: int) -> int:
        """Where the prefill chunk starting at token ``start`` of ``total`` ends (positions in the sequence): the
        forwards a prompt is read in (:meth:`forward`; the batched engine reads them a few a round, and must read the
        same ones). On the compiled layers' AVX2 builds the first :attr:`alone_positions` positions go in chunks of as
        many rows as they read row-wise, and the rest in chunks of ``prefill_chunk`` counted from there."""
        alone = self.alone_positions
        if not alone:
            return min(start + self.prefill_chunk, total)
        if start < alone:
            return min(start + int(self.lean.prefill_gemm_rows) - 1, alone, total)
        return min(alone + ((start - alone) // self.prefill_chunk + 1) * self.prefill_chunk, total)

    @property
    def alone_positions(self) -> int:
        """The leading positions of any prompt that the compiled layers' AVX2 builds read row by row, each row alone
        (``alone_prompt_tokens``, backends/lean_forward.py; 0 elsewhere): their entries are the bits any other reading
        of the same tokens writes, a chunk at a time, a token at a time or after another prompt's kept entries
        (batch/prompt_cache.py). 0 on a model with sliding-window layers (Gemma 3), whose caches the prompt cache
        does not keep: it reads its prompts the GEMM's faster way."""
        lean = self.lean
        if (lean is None or lean.compiled is None or lean.prefill_gemm_rows == math.inf
                or self.cache.sliding_window is not None):
            return 0
        return lean.alone_prompt_tokens

    def _lean_call(self, token_ids, parents, num_logits, output_hidden, argmax_only, attend_to=None,
                   top_k_only: int = 0, draws: RowDraws | None = None,
                   allowed: torch.Tensor | None = None) -> LeanCall:
        """The model-level arguments of a forward: ids, positions, the tree mask, rows of logits, hidden states."""
        device = self.device  # read once: the module finds it by walking its parameters
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=device).reshape(1, -1)  # [1, n]
        n = ids.shape[1]
        if n == 0:
            raise ValueError("forward needs at least one token")
        start = self.num_cached
        chain = parents is None or parents == chain_parents(n)
        if chain and attend_to is None:
            positions = torch.arange(start, start + n, device=device)
            mask = None
        else:
            if not chain and len(parents) != n:
                raise ValueError(f"parents has {len(parents)} entries for {n} tokens")
            positions = (torch.arange(n, device=self.device) if chain
                         else torch.tensor(tree_depths(parents), device=self.device)) + start
            if attend_to is None:
                visible = torch.ones(n, start + n, dtype=torch.bool, device=self.device)
            else:
                attend_to = torch.as_tensor(attend_to, dtype=torch.long, device=self.device)
                if len(attend_to) and (int(attend_to[0]) < 0 or int(attend_to[-1]) >= start):
                    raise ValueError(f"attend_to must name cached positions (0 to {start - 1})")
                visible = torch.zeros(n, start + n, dtype=torch.bool, device=self.device)
                visible[:, attend_to] = True
            visible[:, start:] = (torch.ones(n, n, dtype=torch.bool, device=self.device).tril() if chain
                                  else tree_ancestor_mask(parents).to(self.device))
            window = self.cache.sliding_window
            if window is None:
                mask = self._additive_mask(visible)
            else:  # a 4-D mask is taken as given: the sliding layers' window (or chunk) must be in it
                key_positions = torch.cat([torch.arange(start, device=self.device), positions])
                chunk = getattr(self.model.config, "attention_chunk_size", None)
                if "chunked_attention" in (getattr(self.model.config, "layer_types", None) or ()) and chunk:
                    # (Llama 4's: a key is seen from its own chunk of positions only)
                    kind, near = "chunked_attention", key_positions[None, :] // chunk == positions[:, None] // chunk
                else:
                    kind, near = "sliding_attention", sliding_window_mask(positions, key_positions, window)
                sliding = self._additive_mask(visible & near)
                mask = sliding if all(self.cache.is_sliding) else {"full_attention": self._additive_mask(visible),
                                                                   kind: sliding}
        keep = n if num_logits is None else num_logits
        layers = sorted({layer for mirror in self.mirrors if mirror.synced for layer in mirror.layers}
                        | ({-1} if output_hidden else set()))
        return LeanCall(ids, positions.reshape(1, -1), mask, self.cache, keep, tuple(layers), argmax_only,
                        top_k_only, draws, allowed)

    def _additive_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """[rows, keys] bool -> the additive float mask [1, 1, rows, keys] that eager and sdpa attention take as
        given."""
        mask = torch.zeros(1, 1, *visible.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible, torch.finfo(self.dtype).min)

    def _finish(self, call: LeanCall, output_hidden: bool, logits: torch.Tensor,
                states: dict[int, torch.Tensor]) -> ForwardOutput:
        """Count the new tokens as cached, feed the feature mirrors, and shape the output."""
        self.num_cached += call.input_ids.shape[1]
        if self.cache.convolutions:  # (inputs recorded back to the oldest copy of the recurrent states at least:
            # what a crop back to it takes out, a long draft's whole round included)
            copies = self.states.snapshots if self.states is not None else None
            self.cache.keep_recent(max(ROLLBACK_ROOM, self.num_cached - copies[0].length) if copies else ROLLBACK_ROOM)
        # (tokens read again, at the start of this forward or of the chunks up to it: the mirrors have their features)
        replayed = min(self._replayed, call.input_ids.shape[1])
        self._replayed -= replayed
        for mirror in self.mirrors:
            if mirror.synced:
                mirror.append(states[-1][0, replayed:] if mirror.layers == (-1,) else  # [n, hidden * layers]
                              torch.cat([states[layer][0, replayed:] for layer in mirror.layers], -1))
        keep = call.num_logits
        hidden = states[-1][0, -keep:] if output_hidden and keep > 0 else None
        return ForwardOutput(logits=logits[0].float(), hidden=hidden)

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The exact head's logits [n, vocab] of final-normed hidden rows [n, width] (``ForwardOutput.hidden``), as a
        forward that reads every logit computes them: what a screened forward's rows are, whole."""
        if self.lean is None:  # (no screen either: its forwards' logits are already whole)
            raise UnsupportedOptionError(f"target '{self.name}' runs transformers' own forward, whose logits are "
                                         "whole: read them from the forward")
        return self.lean._head(hidden[None], len(hidden), 0)[0].float()

    @property
    def reads_attention(self) -> bool:
        """Whether :meth:`attention_mass` can run: the model takes the lean forward of a Llama-family model."""
        return self.lean is not None and self.lean.reads_attention

    @torch.inference_mode()
    def attention_mass(self, token_ids: list[int]) -> torch.Tensor:
        """How much attention ``token_ids``, fed after the cache as a chain, would pay each cached token:
        [layers, query heads, num_cached], each new row's softmax weights summed over the rows
        (:func:`~jointspec.backends.lean_forward.attention_mass`). The cache is left as it was. Needs the lean
        forward (a Llama-family model)."""
        if not self.reads_attention:
            raise UnsupportedOptionError(f"target '{self.name}' runs transformers' own forward, so its attention "
                                         "cannot be read; attention by lookahead needs a Llama-family model")
        start, layers = self.num_cached, self.model.config.num_hidden_layers
        call = self._lean_call(token_ids, None, 0, False, False)
        _, states = self.lean(call.input_ids, call.position_ids, None, self.cache, 0, tuple(range(layers)))
        try:
            return attention_mass(self.model.model, [states[i] for i in range(layers)], call.position_ids,
                                  self.cache, start)
        finally:
            self.cache.crop(-len(token_ids))  # transformers >= 5 takes a negative count of tokens to remove

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens."""
        if not 0 <= length <= self.num_cached:
            raise ValueError(f"cannot crop a cache of {self.num_cached} tokens to {length}")
        if length == 0 and self.cache.convolutions and self.num_cached:
            history = self.states  # (no state at all: what a convolution's recorded inputs need not reach back to)
            self.reset(plain=history is not None and history.plain, length=history.length if history else None)
        elif self.states is not None:
            self.states.release_before(length)
            if length < self.num_cached:
                self._crop_hybrid(length)
        elif length < self.num_cached:
            # transformers >= 5 takes the number of tokens to remove as a negative count.
            self.cache.crop(length - self.num_cached)
            self.num_cached = length
            for mirror in self.mirrors:
                if mirror.synced:
                    mirror.crop(length)

    @torch.inference_mode()  # (the states are inference tensors, written in place)
    def _crop_hybrid(self, length: int) -> None:
        """:meth:`crop` for a hybrid model (backends/recurrent.py): tokens still to read again are dropped from that
        list; earlier ones out of the convolutions' recorded inputs, and out of the recurrent states by putting back
        the copy taken before them."""
        history = self.states
        held = self.num_cached - len(history.replay)  # (the tokens in the cache itself)
        if length >= held:
            del history.replay[length - held:]
        else:
            start, states = length, None
            if history.recurrent:
                snapshot = history.latest_at_most(length)
                start, states = (snapshot.length, snapshot.states) if snapshot is not None else (None, None)
            if start is not None and self.cache.records_back(held - start, start):
                self.cache.crop(start - held, states=states)
                history.replay = history.tokens[start:length]
            else:  # no copy reaches back so far, or the convolutions' inputs do not: all of them read again
                log.debug("%s: the states reach back less than %d tokens: reading %d tokens again",
                          self.name, self.num_cached - length, length)
                self.cache = BufferedCache(self.model.config, self.kv_dtype, length=history.length)
                history.snapshots.clear()
                history.replay = history.tokens[:length]
        del history.tokens[length:]
        self.num_cached = length
        for mirror in self.mirrors:
            if mirror.synced:
                mirror.crop(length)

    def keep(self, positions: list[int]) -> None:
        """Keep the cached tokens at ``positions`` (increasing), in that order, and drop the rest.

        Used after a tree verification: the accepted path is scattered among its siblings in the cache. Keys were
        rotated at their logical positions (depths), so gathering them preserves correctness.
        """
        if positions == list(range(len(positions))):
            self.crop(len(positions))
            return
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        self.cache.keep(index)
        for mirror in self.mirrors:
            if mirror.synced:
                mirror.keep(index)
        self.num_cached = len(positions)


@torch.inference_mode()
def forward_many(targets: list[TargetLM], calls: list[ForwardCall]) -> list[ForwardOutput]:
    """``[call.run(target) for target, call in zip(targets, calls)]``, with the same results, but in one pass where
    the targets are adapters of one model on jointspec's compiled CPU layers (:meth:`LeanLlamaForward.forward_many`):
    the batched engine's round, one sequence per target. Elsewhere each call runs alone."""
    lean = targets[0].lean if targets and isinstance(targets[0], CausalLM) else None
    if lean is not None and len(targets) > 1 and all(
            isinstance(target, CausalLM) and target.lean is lean for target in targets):
        plans = [target._lean_call(call.token_ids, call.parents, call.num_logits, call.output_hidden,
                                   call.argmax_only, top_k_only=call.top_k_only, draws=call.draws,
                                   allowed=call.allowed)
                 for target, call in zip(targets, calls)]
        together = lean.forward_many(plans)
        if together is not None:
            return [target._finish(plan, call.output_hidden, logits, states)
                    for target, plan, call, (logits, states) in zip(targets, plans, calls, together)]
    return [call.run(target) for target, call in zip(targets, calls)]
