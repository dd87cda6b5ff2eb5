"""A feature-level draft head (EAGLE-style) and the adapter that makes it a draft model like any other.

**The head.** The target's last hidden state after the final norm is its *feature*: ``feature_t`` at position ``t``
gives the target's logits for token ``t + 1`` through the target's LM head. The head is one decoder layer that reads,
at position ``t``, ``fc([feature_t ; embed(token_{t+1})])`` and predicts ``feature_{t+1}``; the target's own LM head
(frozen, optionally restricted to the draft vocabulary: VocabTrim) turns that into a draft for token ``t + 2``.
Drafting further feeds the head its own predicted feature. Only ``fc`` and the decoder layer are trained and saved
(a few MB); the embedding and LM head are the target's, so the head only fits the target it was trained on.

**Fused features** (EAGLE-3's multi-layer fusion, optional: ``fuse_layers``): the last feature is made to predict the
next token, so it may have dropped context that the token after needs. A head with ``fuse_layers`` also reads the
target's hidden states at those indices (each RMS-normalised: the residual stream grows with depth) and adds a
learnt projection of them to the feature: ``feature_t + fuse_fc([h_a ; h_b ; ...])``. ``fuse_fc`` starts at zero,
so a head trained without fusion is the starting point of one trained with it. Only true target positions have
these hidden states; drafting further feeds the head's own prediction as before.

**The adapter.** :class:`HeadDraftModel` has the :class:`~jointspec.backends.hf.CausalLM` interface (``forward``
with chains or trees, ``crop``, ``keep``, ``reset``), so every model-based drafter (``sps``, ``mtad``, ``specinfer``,
``spectr``) can use a head through ``--draft DIR``. It reads the target's true features from a
:class:`~jointspec.backends.hf.FeatureMirror`, which the target adapter fills on every forward. Entry ``p`` of the
head's cache holds token ``p``, fed with the feature of position ``p - 1``: the target's true feature when the target
has already scored position ``p - 1`` (committed text), else the head's own prediction (draft text). Entries fed
with a prediction are *inexact*: once the target has scored those positions, the true features are better inputs, so
``crop``/``keep`` drop every inexact entry and the drafter feeds those tokens again. Drafters therefore read
``num_cached`` back after ``crop``/``keep`` (it may be smaller than asked).

**Long contexts.** A head fed a long context in one call (a long prompt, a long new turn) keeps only the first
:data:`HEAD_SINK_ENTRIES` entries and the last :data:`HEAD_WINDOW` of it, numbered as one unbroken sequence (the
entries between are *skipped*: counted in ``num_cached``, not held). It does so only where the caller reads no more
than the window's last rows (``num_logits``), the window's first entry reads a feature the target has scored, and
the sinks were fed true features; ``context_logits_many`` leaves such a chain to a call alone. Heads are trained on
sequences of about a thousand tokens, so a window of that size keeps the distances they learnt, and feeding every
position of a 7k prompt through the head's layer cost more than its drafts saved there (docs/long-inputs.md). It
changes drafts only, never what lossless verification keeps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaModel

from jointspec.backends.hf import CausalLM, tree_ancestor_mask
from jointspec.backends.kvcache import BufferedCache
from jointspec.backends.lean_forward import CompiledBody, body_unsupported_reason, lean_body_forward
from jointspec.core.draft import chain_parents, tree_depths
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.target import ForwardOutput
from jointspec.drafts.artifact import (
    HEAD_WEIGHT_CHOICES,
    FeatureDraft,
    HeadConfig,
    check_head_target,
    float_lm_rows,
    full_vocab_logits,
    load_artifact,
    save_artifact,
)
from jointspec.kernels.fp32 import OneDNNLinear, kernels_in_use, onednn_supported, use_onednn_linears

# A chain fed in one call that would leave more than HEAD_SINK_ENTRIES + HEAD_WINDOW entries skips the ones between
# (see the module docstring). The leading entries are kept as attention sinks: a head trained on sequences that all
# begin with a chat template's first tokens may attend there as the models it mirrors do.
HEAD_WINDOW = 1024
HEAD_SINK_ENTRIES = 4


class EagleHead(nn.Module):
    """``fc`` over [feature ; token embedding], then ``num_layers`` Llama decoder layers and a norm."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        body_config = LlamaConfig(
            vocab_size=1, hidden_size=hidden, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
            rope_theta=config.rope_theta, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
        self.body = LlamaModel(body_config)  # its 1-row token embedding is never used: inputs come as embeddings
        # Tokens outside the draft vocabulary are never drafted; the table maps draft rows to target token ids.
        size = config.draft_vocab_size or config.target_vocab_size
        self.register_buffer("draft_vocab", torch.arange(size, dtype=torch.long))
        self.fuse_fc = None
        if config.fuse_layers:
            self.fuse_fc = nn.Linear(len(config.fuse_layers) * hidden, hidden, bias=False)
            nn.init.zeros_(self.fuse_fc.weight)  # start as the unfused head (see the module docstring)

    def fuse(self, wide: torch.Tensor) -> torch.Tensor:
        """[..., hidden * (1 + len(fuse_layers))] target hidden states (the last first) -> [..., hidden] input
        feature. A head without fused layers reads the last feature alone (wider input is cut)."""
        hidden = self.config.hidden_size
        feature = wide[..., :hidden]
        if self.fuse_fc is None:
            return feature
        other = wide[..., hidden:].unflatten(-1, (len(self.config.fuse_layers), hidden))
        other = other * torch.rsqrt(other.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return feature + self.fuse_fc(other.flatten(-2))

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, *, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: DynamicCache | None = None,
                lean: bool | Callable = False) -> torch.Tensor:
        """``features``/``token_embeds``: [batch, n, hidden] -> predicted next features [batch, n, hidden].

        ``lean`` (drafting, with a cache, where :func:`~jointspec.backends.lean_forward.body_unsupported_reason`
        allows):
        the body through the lean forward, the same operations without transformers' per-module overhead, a large
        share of a draft call on SmolLM2's small head (docs/kernels.md); or a callable with its arguments that runs
        the body another way (:class:`~jointspec.backends.lean_forward.CompiledBody`)."""
        x = self.fc(torch.cat([features, token_embeds], dim=-1))
        if lean and cache is not None:
            body = lean if callable(lean) else functools.partial(lean_body_forward, self.body)
            return body(x, position_ids, attention_mask, cache)
        out = self.body(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                        past_key_values=cache, use_cache=cache is not None)
        return out.last_hidden_state

    def save(self, folder: str | Path, training: dict | None = None) -> Path:
        """Write ``draft.json`` and fp16 weights into ``folder`` (created; files replaced atomically)."""
        return save_artifact(self, self.config, folder, training)


def bind_head(folder: str | Path, target: CausalLM, weights: str = "auto") -> HeadDraftModel:
    """Load the head saved in ``folder`` for ``target``; refuses a head trained for another target. ``weights``:
    see :data:`HEAD_WEIGHT_CHOICES`."""
    head, training = load_head(folder, device=target.device, dtype=torch.float32)
    check_head_target(head, folder, target)
    return HeadDraftModel(head, target, name=f"head {Path(folder).name}", weights=weights)


def context_logits_many(drafts: list[HeadDraftModel], token_lists: list[list[int]]) -> list[torch.Tensor] | None:
    """``[d.forward(tokens, num_logits=1).logits[-1] for d, tokens in zip(drafts, token_lists)]``, each draft
    (a request's head, all bound from one template) fed committed tokens whose input features the target has
    scored: in one pass of the head's weights, which every call otherwise reads again. The same bits and the same
    state afterwards as each call alone (its int8 linears and compiled layer compute each row alone). None, with no
    draft touched, where this path does not take them all: then call each alone.

    What a batched server's round does for MTAD's requests: each drafts from its head's logits after its committed
    text, and one call a request would read the head's ~14 MB of weights once for each (batch/lockstep.py). Only
    jointspec's own EAGLE-style heads (exactly :class:`HeadDraftModel`: the engines' EAGLE-1 and EAGLE-3 layouts
    compute otherwise) on int8 weights with their layer compiled."""
    from jointspec.kernels.grouped import ROWWISE_MAX_ROWS

    first = drafts[0] if drafts else None
    body = getattr(first, "_lean", None)
    if (len(drafts) < 2 or not isinstance(body, CompiledBody) or first._lm_int8 is None
            or sum(map(len, token_lists)) > ROWWISE_MAX_ROWS or any(
                type(d) is not HeadDraftModel or d.head is not first.head or d._lean is not body
                or len(tokens) > d.window + HEAD_SINK_ENTRIES  # (a call alone might keep a window of them)
                or d._lm_int8 is not first._lm_int8 or d._tree_tail or not tokens
                or d.num_cached + len(tokens) - 1 > d.known_features()  # every input a true feature
                for d, tokens in zip(drafts, token_lists))):
        return None
    with torch.inference_mode():
        # _run's inputs, request by request: its tokens' embeddings, their input features, their positions.
        embeds, features, positions = [], [], []
        for d, tokens in zip(drafts, token_lists):
            start = d.num_cached
            embeds.append(d.embed(torch.tensor(tokens, dtype=torch.long, device=d.device)).to(d.dtype))
            features.append(torch.stack([d._input_feature(start + j) for j in range(len(tokens))]))
            positions.append(torch.arange(start, start + len(tokens), device=d.device)[None] - d.skipped)
        x = first.head.fc(torch.cat([torch.cat(features), torch.cat(embeds)], dim=-1)[None])  # EagleHead's fc
        sizes = [len(tokens) for tokens in token_lists]
        outs = body.forward_many(list(x.split(sizes, dim=1)), positions, [d.cache for d in drafts])
        if outs is None:
            return None
        logits = first._lm_int8(torch.stack([out[-1] for out in outs]).float())  # [drafts, draft vocab]
        results = []
        for d, tokens, out, row in zip(drafts, token_lists, outs, logits):
            start = d.num_cached
            for entry in range(start, start + len(tokens)):  # as _forward_chain counts the entries fed true features
                if d.num_exact == entry:
                    d.num_exact = entry + 1
            d._append_predicted(out)
            d.num_cached += len(tokens)
            d._fed_tokens, d._fed_parents, d._fed_out = list(tokens), chain_parents(len(tokens)), out
            results.append(full_vocab_logits(row, d.draft_vocab, d._full_vocab))
    return results


def load_head(folder: str | Path, *, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> tuple[EagleHead, dict]:
    """Load a saved head (weights back to ``dtype``) and its training record."""
    return load_artifact(folder, HeadConfig, EagleHead, device=device, dtype=dtype)


def float_activations(head: nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and dtype a head computes in: its float parameters' (the norms', which int8 weights never replace;
    a head bound once already may hold int8 linears, since binding converts them in place)."""
    weight = next(p for p in head.parameters() if p.is_floating_point())
    return weight.device, weight.dtype


def int8_head_misfit(head: nn.Module, body: nn.Module | None = None) -> str | None:
    """Why ``head`` cannot run its ``body``'s linears (default: ``head.body`` and ``fc``) on int8 weights (None: it
    can)."""
    from jointspec.kernels.grouped import grouped_misfit, unavailable_reason

    device, dtype = float_activations(head)
    if device.type != "cpu" or dtype != torch.float32:
        return f"int8 head weights are for float32 heads on the CPU; this one is {dtype} on {device}"
    # An EAGLE-style head's fc goes on int8 too (HeadDraftModel._use_int8); an EAGLE-3 head's (``body`` given) stays.
    linears = [("fc", head.fc), *head.body.named_modules()] if body is None else list(body.named_modules())
    misfit = next((f"{name}: {reason}" for name, module in linears if type(module) is nn.Linear
                   for reason in [grouped_misfit(module)] if reason), None)
    if misfit is None and head.config.hidden_size % 64:
        misfit = f"the hidden size {head.config.hidden_size} is not a multiple of 64"
    return misfit or unavailable_reason()  # builds the kernels once if it can (a minute or more)


def layer_llama_config(config: HeadConfig, num_layers: int, rope_parameters: dict | None) -> LlamaConfig:
    """The transformers config of the decoder layers of a head made for vLLM or SGLang (EAGLE-1, EAGLE-3), from its
    shape; ``rope_parameters`` None: default rope at ``config.rope_theta``."""
    rope = rope_parameters or {"rope_type": "default", "rope_theta": config.rope_theta}
    llama = LlamaConfig(vocab_size=config.target_vocab_size, hidden_size=config.hidden_size,
                        intermediate_size=config.intermediate_size, num_hidden_layers=num_layers,
                        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                        rms_norm_eps=config.rms_norm_eps, rope_parameters=dict(rope), bos_token_id=None,
                        eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    llama._attn_implementation = "sdpa"
    return llama


def engine_head_mask(features: torch.Tensor, cache, attention_mask: torch.Tensor | None,
                     hide_first_entry: bool) -> torch.Tensor:
    """The additive attention mask of a head made for vLLM or SGLang (EAGLE-1, EAGLE-3) over ``features`` [1, n,
    hidden] after ``cache``'s entries: ``attention_mask`` as given (a tree's), or a causal chain after the cache.

    ``hide_first_entry``: entry 0 (the first token, with no feature before it) is not in such a head's cache: the
    engines' first draft entry is the second token with the first position's feature. It stays in jointspec's cache,
    seen by no later entry, so that entry p still holds token p."""
    n = features.shape[1]
    cached = cache.get_seq_length() if cache is not None else 0
    if attention_mask is None:
        visible = torch.ones(n, cached + n, dtype=torch.bool, device=features.device).tril(cached)
        attention_mask = torch.zeros(1, 1, n, cached + n, dtype=features.dtype, device=features.device)
        attention_mask.masked_fill_(~visible, torch.finfo(features.dtype).min)
    if hide_first_entry:
        attention_mask = attention_mask.clone()
        attention_mask[..., 1 if cached == 0 else 0:, 0] = torch.finfo(attention_mask.dtype).min
    return attention_mask


def chosen_head_weights(head: nn.Module, weights: str, body: nn.Module | None = None) -> str:
    """How ``head`` runs for the choice ``weights`` (:data:`HEAD_WEIGHT_CHOICES`): "int8" or "float32"; refuses an
    unknown choice, and ``int8`` where the kernel cannot take ``body``'s linears (:func:`int8_head_misfit`)."""
    if weights not in HEAD_WEIGHT_CHOICES:
        raise UnsupportedOptionError(f"unknown head weights '{weights}'; choose one of: "
                                     f"{', '.join(HEAD_WEIGHT_CHOICES)}")
    from jointspec.kernels.grouped import AUTO_ISAS, GroupedInt8Linear, selected_isa
    from jointspec.kernels.probe import cached

    # The portable build is exact but unmeasured against float32 heads, and the ARM one measured only where --quantize
    # auto asked (kernels/probe.py): auto keeps float32 there unless that measurement found the kernels faster
    # (decided before the misfit check, which builds the kernels), as --quantize auto keeps the float32 model, unless
    # the head was bound with int8 before (binding converts it in place); int8 asked for runs it.
    device, dtype = float_activations(head)
    if weights == "auto" and device.type == "cpu" and dtype == torch.float32:
        isa = selected_isa()
        if (isa not in AUTO_ISAS and not ((probe := cached(isa)) is not None and probe.int4_faster)
                and not any(isinstance(module, GroupedInt8Linear) for module in head.modules())):
            return "float32"
    misfit = int8_head_misfit(head, body) if weights != "float32" else None
    if weights == "int8" and misfit:
        raise UnsupportedOptionError(f"head_weights=int8: {misfit}; use head_weights=float32 or auto")
    return "int8" if weights != "float32" and misfit is None else "float32"


def linears_to_int8(module: nn.Module) -> None:
    """Replace every ``nn.Linear`` inside ``module`` by its int8 grouped-kernel copy (:data:`HEAD_WEIGHT_CHOICES`)."""
    from jointspec.kernels.grouped import GroupedInt8Linear

    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:  # after the walk: it never sees a half-rewritten tree
        setattr(parent, name, GroupedInt8Linear(child))


class HeadDraftModel(FeatureDraft):
    """A trained head, bound to its target, behind the CausalLM interface (see the module docstring)."""

    window = HEAD_WINDOW  # entries kept after the sinks of a long chain (module docstring)

    def __init__(self, head: EagleHead, target: CausalLM, name: str = "draft head", weights: str = "auto") -> None:
        super().__init__(target, name, head.config.feature_layers)
        self.head = head.to(target.device).eval()  # a head built or loaded on another device runs beside its target
        self._device, self._dtype = float_activations(self.head)
        model = target.model
        self.embed = model.get_input_embeddings()
        # Rows of the target's LM head for the draft vocabulary, copied once so each draft step is one small matmul.
        self.lm_weight = float_lm_rows(model, head.draft_vocab).detach().to(self._dtype)
        self.draft_vocab = head.draft_vocab
        self._lm_int8 = None
        self._lm_onednn = None
        self.weights = chosen_head_weights(self.head, weights)
        if self.weights == "int8":
            self._use_int8()
        # A target on oneDNN linears (float32 CPU, kernels.fp32) gets a float head on them too: drafting is the
        # same small-batch matmuls.
        elif kernels_in_use(model) == "onednn" and onednn_supported(self.head) is None:
            use_onednn_linears(self.head)
            self._lm_onednn = OneDNNLinear(self._lm_linear())
        self._lean = body_unsupported_reason(self.head.body) is None
        # int8 weights: the body's one layer as one compiled call where it fits (drafting's largest cost otherwise).
        if self._lean and self.weights == "int8":
            self._lean = CompiledBody.maybe(self.head.body) or True
        self.reset()

    def _use_int8(self) -> None:
        """Swap fc, the body's linears and the LM head rows for int8 weight groups (see :data:`HEAD_WEIGHT_CHOICES`)."""
        from jointspec.kernels.grouped import GroupedInt8Linear

        if type(self.head.fc) is nn.Linear:  # a head bound before has it converted already
            self.head.fc = GroupedInt8Linear(self.head.fc)
        linears_to_int8(self.head.body)
        self._lm_int8 = GroupedInt8Linear(self._lm_linear())

    def _lm_linear(self) -> nn.Linear:
        """The draft vocabulary's rows of the target's LM head as an ``nn.Linear`` (sharing ``lm_weight``)."""
        lm = nn.Linear(self.lm_weight.shape[1], self.lm_weight.shape[0], bias=False)
        lm.weight = nn.Parameter(self.lm_weight, requires_grad=False)
        return lm

    @property
    def config(self):
        return self.head.body.config

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _new_cache(self) -> BufferedCache:
        # Written in place, not concatenated: a draft call then copies nothing of the context (backends/kvcache.py).
        return BufferedCache(self.head.body.config)

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.num_cached = 0
        self.num_exact = 0  # leading cache entries fed with true target features
        # Entries skipped after the sinks of a long context (module docstring): entry p >= HEAD_SINK_ENTRIES +
        # skipped is held at cache slot and position p - skipped.
        self.skipped = 0
        # The head's predicted features for entries predicted_from .. num_cached - 1: a view of a buffer that grows
        # by doubling, so that a call does not copy every earlier row (tensors of a few MB a call at 1-2k entries).
        # After a crop, later calls write over the rows it dropped: a reader that keeps them keeps a clone.
        self.predicted_from = 0
        self._predicted_room = torch.zeros(0, self.head.config.hidden_size, dtype=self.dtype, device=self.device)
        self.predicted = self._predicted_room[:0]
        self._tree_tail = False  # the cache ends in tree nodes: only crop/keep/extend_tree may follow
        # The last forward's tokens as a tree (a chain is one too) and its outputs: what extend_tree may grow.
        self._fed_tokens: list[int] = []
        self._fed_parents: list[int] = []
        self._fed_out = self.predicted

    def _input_feature(self, entry: int) -> torch.Tensor | None:
        """The feature fed with the token at cache entry ``entry`` (None: not computed yet)."""
        source = entry - 1
        if source < 0:
            return torch.zeros(self.head.config.hidden_size, dtype=self.dtype, device=self.device)
        if source < self.known_features():  # the target has scored it: committed text, true feature
            return self.head.fuse(self.mirror.features[source].to(self.dtype))
        if self.predicted_from <= source < self.predicted_from + self.predicted.shape[0]:
            return self.predicted[source - self.predicted_from]
        return None

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        """[n, hidden] predicted features -> [n, full vocab] logits, -inf outside the draft vocabulary."""
        if self._lm_int8 is not None:
            draft_logits = self._lm_int8(features.float())  # [n, draft vocab]
        elif self._lm_onednn is not None:
            draft_logits = self._lm_onednn(features.float())  # [n, draft vocab]
        else:
            draft_logits = features.float() @ self.lm_weight.float().T  # [n, draft vocab]
        return full_vocab_logits(draft_logits, self.draft_vocab, self._full_vocab)

    def _run(self, token_ids: list[int], inputs: list[torch.Tensor], positions: list[int],
             mask: torch.Tensor | None) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        embeds = self.embed(ids).to(self.dtype)[None]  # [1, n, hidden]
        features = torch.stack(inputs)[None]  # [1, n, hidden]
        position_ids = torch.tensor([p - self.skipped for p in positions], device=self.device)[None]
        out = self.head(features, embeds, position_ids=position_ids, attention_mask=mask, cache=self.cache,
                        lean=self._lean)[0]
        self._append_predicted(out)
        self.num_cached += len(token_ids)
        return out

    def _append_predicted(self, rows: torch.Tensor) -> None:
        """``rows`` [n, hidden] after :attr:`predicted` (the features the head predicted at the entries just fed)."""
        held, end = self.predicted.shape[0], self.predicted.shape[0] + rows.shape[0]
        room = self._predicted_room
        if end > room.shape[0]:
            room = torch.empty(max(end, 2 * room.shape[0], 64), room.shape[1], dtype=room.dtype, device=room.device)
            room[:held] = self.predicted
            self._predicted_room = room
        room[held:end] = rows
        self.predicted = room[:end]

    @torch.inference_mode()
    def forward(self, token_ids: list[int] | torch.Tensor, *, parents: list[int] | None = None,
                num_logits: int | None = None, output_hidden: bool = False) -> ForwardOutput:
        token_ids = [int(t) for t in (token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids)]
        n = len(token_ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if self._tree_tail:
            raise UnsupportedOptionError("a draft head cannot extend a tree draft; crop or keep its cache first")
        if parents is None or parents == chain_parents(n):
            # Entries may be skipped only where no caller reads their rows.
            outputs = self._forward_chain(token_ids, window=num_logits is not None and num_logits <= self.window)
            fed = token_ids[n - outputs.shape[0]:]
            self._fed_tokens, self._fed_parents, self._fed_out = fed, chain_parents(len(fed)), outputs
        else:
            outputs = self._forward_tree(token_ids, parents)
        return self._output(outputs, num_logits, output_hidden)

    @torch.inference_mode()
    def extend_tree(self, token_ids: list[int], parents: list[int], *, num_logits: int) -> ForwardOutput:
        """Feed the nodes a tree gained since the last tree call; ``token_ids``/``parents`` are the whole tree.

        Tree drafters grow a tree level by level. A plain forward would crop the tree and feed it again (every node
        of the last call becomes visible to every node of the next, so a generic cache cannot do better); the
        head builds its own ancestor masks, so it scores only the new nodes, each seeing its ancestors among the
        nodes already cached. The logits are those of ``forward(tree)`` after a crop: same nodes, same masks (up to
        float rounding where the tree fed last was a chain, which takes the unmasked chain path).
        """
        old = len(self._fed_tokens)
        if not (0 < old < len(token_ids) and token_ids[:old] == self._fed_tokens
                and parents[:old] == self._fed_parents):
            raise ValueError("extend_tree needs the tree fed last, grown by at least one node")
        outputs = self._forward_tree([int(t) for t in token_ids], list(parents), first=old)
        return self._output(outputs, num_logits, False)

    def _output(self, outputs: torch.Tensor, num_logits: int | None, output_hidden: bool) -> ForwardOutput:
        n = outputs.shape[0]
        keep = n if num_logits is None else num_logits
        rows = outputs[n - keep:] if keep > 0 else outputs[:0]
        return ForwardOutput(logits=self._logits(rows), hidden=rows if output_hidden else None)

    def _skip_to_window(self, token_ids: list[int]) -> int:
        """Before a chain of ``token_ids`` is fed: where it would leave more than the sinks and the window, drop the
        held entries after the sinks and skip the chain's tokens before its last HEAD_WINDOW (feeding the sinks first
        where the cache holds fewer). Returns how many of ``token_ids`` are consumed (0: nothing skipped)."""
        start, n = self.num_cached, len(token_ids)
        window_start = start + n - self.window  # the first entry of the window this chain leaves
        if (n <= self.window + HEAD_SINK_ENTRIES or window_start > self.known_features()
                or self.num_exact < min(start, HEAD_SINK_ENTRIES)):
            return 0  # short; the window's first input would be a prediction; or a kept sink was fed one
        consumed = 0
        if start < HEAD_SINK_ENTRIES:  # a fresh cache: the sinks first, as any chain
            consumed = HEAD_SINK_ENTRIES - start
            self._forward_chain(token_ids[:consumed], window=False)
        held = self.num_cached - self.skipped
        if held > HEAD_SINK_ENTRIES:
            self.cache.crop(HEAD_SINK_ENTRIES - held)
        self.skipped = window_start - HEAD_SINK_ENTRIES
        self.num_cached = self.num_exact = self.predicted_from = window_start
        self.predicted = self.predicted[:0]
        return window_start - start

    def _forward_chain(self, token_ids: list[int], window: bool = True) -> torch.Tensor:
        # Feed in segments: a token whose input is the prediction of a token in the same call must wait for it.
        outputs: list[torch.Tensor] = []
        i = self._skip_to_window(token_ids) if window else 0
        while i < len(token_ids):
            start = self.num_cached
            inputs: list[torch.Tensor] = []
            while i + len(inputs) < len(token_ids):
                entry = start + len(inputs)
                feature = self._input_feature(entry)
                if feature is None:
                    break
                if self.num_exact == entry and entry - 1 < self.known_features():
                    self.num_exact = entry + 1
                inputs.append(feature)
            assert inputs, "a draft head was fed a token whose input feature does not exist"
            count = len(inputs)
            outputs.append(self._run(token_ids[i:i + count], inputs, list(range(start, start + count)), None))
            i += count
        return torch.cat(outputs)

    def _forward_tree(self, token_ids: list[int], parents: list[int], first: int = 0) -> torch.Tensor:
        # Level by level: a node's input is its parent's predicted feature, so a level waits for the one above.
        # ``first`` > 0: nodes before it are the tree already cached (extend_tree), their outputs kept from then.
        n = len(token_ids)
        depths = tree_depths(parents)
        if depths != sorted(depths):
            raise ValueError("a draft head takes tree nodes level by level (depths must not decrease)")
        start = self.num_cached - first
        held = start - self.skipped  # the cache's entries before the tree
        ancestors = tree_ancestor_mask(parents).to(self.device)  # [n, n]
        root_input = self._input_feature(start)
        assert root_input is not None, "a draft head was fed a tree after a token it has not seen"
        out = torch.empty(n, self.head.config.hidden_size, dtype=self.dtype, device=self.device)
        if first:
            out[:first] = self._fed_out
        level_start = first
        while level_start < n:
            level_end = level_start
            while level_end < n and depths[level_end] == depths[level_start]:
                level_end += 1
            nodes = list(range(level_start, level_end))
            inputs = [root_input if parents[i] == -1 else out[parents[i]] for i in nodes]
            # Visible: the whole cache before the tree, and each node's own ancestors among the nodes fed so far.
            visible = torch.ones(len(nodes), held + level_end, dtype=torch.bool, device=self.device)
            visible[:, held:] = ancestors[level_start:level_end, :level_end]
            mask = torch.zeros(1, 1, len(nodes), held + level_end, dtype=self.dtype, device=self.device)
            mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
            out[level_start:level_end] = self._run([token_ids[i] for i in nodes], inputs,
                                                   [start + depths[i] for i in nodes], mask)
            level_start = level_end
        self._tree_tail = True
        self._fed_tokens, self._fed_parents, self._fed_out = list(token_ids), list(parents), out
        return out

    def crop(self, length: int) -> None:
        """Keep at most the first ``length`` entries, and never an entry fed with a predicted feature."""
        if not 0 <= length <= self.num_cached:
            raise ValueError(f"cannot crop a cache of {self.num_cached} tokens to {length}")
        length = min(length, self.num_exact)
        if length < self.num_cached:
            held = self.num_cached - self.skipped
            if not self.skipped or length >= HEAD_SINK_ENTRIES + self.skipped:
                self.cache.crop(length - self.num_cached)
            elif length >= HEAD_SINK_ENTRIES:  # back into the skipped entries: the sinks stay, the window goes
                self.cache.crop(HEAD_SINK_ENTRIES - held)
                self.skipped = length - HEAD_SINK_ENTRIES
            else:
                self.cache.crop(length - held)
                self.skipped = 0
            self.num_cached = length
            self.predicted = self.predicted[:max(0, length - self.predicted_from)]
            self.predicted_from = min(self.predicted_from, length)
        self._tree_tail = False
        self._fed_tokens, self._fed_parents = [], []

    def keep(self, positions: list[int]) -> None:
        """Keep the leading run of ``positions`` that is a prefix of the cache (tree paths are fed again)."""
        prefix = 0
        while prefix < len(positions) and positions[prefix] == prefix:
            prefix += 1
        self.crop(min(prefix, self.num_cached))
