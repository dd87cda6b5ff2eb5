"""A lean forward for Llama-architecture models: transformers' own operations, without its per-module machinery.

transformers' ``LlamaForCausalLM`` runs every decoder layer, attention block and norm through ``nn.Module.__call__``
plus its output-capturing hooks, gradient-checkpointing wrappers and keyword-argument plumbing. For a 135M model
decoding one token on a CPU that bookkeeping is a large share of a step: on the embedded SmolLM2 (30 layers) over a
tenth of a plain step went outside the tensor operations themselves (docs/kernels.md;
``benchmarks/fast_forward_cost.py`` measures it). Speculative decoding pays it once per target forward and per draft
call, so it is a fixed cost on every token the loop commits.

:class:`LeanLlamaForward` walks the same modules in the same order and calls the same tensor operations on the same
tensors: the embedding, transformers' own causal-mask builder and rotary embedding, each layer's norm (inlined,
operation for operation as ``LlamaRMSNorm.forward``), its q/k/v/o and MLP projections *as modules* (so quantised
linears, oneDNN linears and anything else that replaced ``nn.Linear`` keep working), transformers'
``apply_rotary_pos_emb``, the cache's ``update`` and the attention function registered for the model's
``_attn_implementation`` (``sdpa``, the grouped-query kernel of :mod:`jointspec.kernels.fp32`, quantisation's
row-wise one, ``eager``), with the arguments transformers passes it. Its logits and hidden states are therefore bit for
bit transformers' (``tests/test_backends_lean_forward.py`` checks ``torch.equal`` on chains, trees, prefill, every
attention
implementation and quantised models), so every exactness argument made for the transformers path carries over.

Two things it does differently, both outside the numbers: it skips the LM head when the caller wants no logits
(transformers computes the logits of every prompt token at prefill, a 49152-wide projection per token on SmolLM2,
when asked for none), and it keeps only the hidden states the caller asks for.

One exception to "the same operations": a model quantised to jointspec's grouped int4 layers (kernels/grouped.py)
runs each decoder layer as one compiled function, all layers in one call into C++
(:meth:`LeanLlamaForward._compiled_layers`), about a third cheaper a
step. That is another summation order of the same quantised model, each row still computed alone, so plain and
speculative decoding of it agree exactly; it is not bit for bit transformers' forward of the quantised model.

Only models whose every part is exactly a transformers class of :data:`FAMILIES` (Llama, and Mistral and Qwen2
without sliding windows) take this path (:func:`lean_forward_for`); a subclass or another architecture runs
transformers' own forward, as does ``--kernels stock``. Gemma-3 and Qwen3 on the grouped kernels take the compiled
layers through subclasses (:class:`~jointspec.backends.lean_gemma.LeanGemmaForward`,
:class:`~jointspec.backends.lean_qwen3.LeanQwen3Forward`), whose hooks here (``NORMS``, ``HEAD_NORMS``,
``_add_extras``...) give the compiled layer what their layers add.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2

# Registrations of modules, parameters and buffers on any module of this process, counted through torch's global
# registration hooks (attribute assignment, register_*, add_module, ModuleList items all call them): while the count
# stands still, no such change has happened, so the compiled layers' full identity check (about 1,300 dictionary
# reads, cold in cache after a forward) need not run again (LeanLlamaForward._compiled_model_ready).
_REGISTRATIONS = [0]


def _count_registration(module, name, value):
    _REGISTRATIONS[0] += 1  # returns None: the value registered is left as it is


for _register in (torch.nn.modules.module.register_module_module_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook,
                  torch.nn.modules.module.register_module_parameter_registration_hook):
    _register(_count_registration)


def _still_held(checks: tuple[list, list, list]) -> bool:
    """Whether every owner dict still holds its expected object under its name (owners, names, objects)."""
    owners, names, expected = checks
    return all(map(operator.is_, map(dict.get, owners, names), expected))  # one C-level loop

# How the compiled layers read a prompt (docs/kernels.md, "Reading the prompt row by row"). The AVX-512 build's
# row-wise product beats dequantising every weight for a GEMM at any length: it reads in chunks of
# ROWWISE_PREFILL_CHUNK rows, all row-wise. The AVX2 build's beats the GEMM up to about that many rows and loses past
# it (against an MKL with AVX-512, and on an AVX2-only CPU for a 1B model): longer prompt forwards keep the GEMM.
# The portable build's row-wise product is scalar code: prefills of PREFILL_GEMM_ROWS rows or more take the GEMM.
PREFILL_GEMM_ROWS = 16
# Entries of the compiled layers' identity checks tested on every forward, from each end (the first and last layers).
COMPILED_SAMPLE = 12
ROWWISE_PREFILL_CHUNK = 128
# The AVX2 builds read the first this many positions of a prompt row-wise too, in chunks of ROWWISE_PREFILL_CHUNK,
# though on a small model the GEMM reads them up to a quarter faster past 128 rows (on a 1B model's shape it reads
# slower): entries computed alone are the bits any other reading of the same tokens writes, so a chat's next turn and
# prompts sharing a system prompt take the kept cache of a finished request (batch/prompt_cache.py), where the GEMM's
# rows let them reuse only whole chunks. Positions past them keep the GEMM chunks (docs/kernels.md, "Short prompts
# row by row on AVX2").
ROWWISE_PROMPT_TOKENS = 1024
# A chunk read through the GEMM holds its activations in every layer, the MLP's most (rows x intermediate floats,
# several times over), and each chunk dequantises every weight again: chunks are cut at the largest power of two of
# rows, at least GEMM_PREFILL_MIN_ROWS, whose rows x intermediate stays within GEMM_PREFILL_ELEMENTS (at most the
# caller's chunk): 256 rows for a 1B model's MLP, 1,024 for SmolLM2-135M's (docs/kernels.md, "An AVX2-only CPU").
GEMM_PREFILL_ELEMENTS = 1 << 21
GEMM_PREFILL_MIN_ROWS = 256


def gemm_prefill_chunk(intermediate: int) -> int:
    """The rows a prompt chunk read through the GEMM takes, for a model with this MLP width."""
    rows = max(1, GEMM_PREFILL_ELEMENTS // max(1, intermediate))
    return max(GEMM_PREFILL_MIN_ROWS, 1 << (rows.bit_length() - 1))


# Architectures whose forward is Llama's, operation for operation: causal LM -> (body, decoder layer, attention, MLP,
# RMS norm, rotary embedding). Qwen2 differs only by biases on q/k/v (inside the projection modules) and an optional
# sliding window, Mistral only by an optional sliding window (Mistral 7B v0.1's; later Mistral models have none):
# the lean forward takes neither window (checked below).
FAMILIES = {
    llama.LlamaForCausalLM: (llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP,
                             llama.LlamaRMSNorm, llama.LlamaRotaryEmbedding),
    mistral.MistralForCausalLM: (mistral.MistralModel, mistral.MistralDecoderLayer, mistral.MistralAttention,
                                 mistral.MistralMLP, mistral.MistralRMSNorm, mistral.MistralRotaryEmbedding),
    qwen2.Qwen2ForCausalLM: (qwen2.Qwen2Model, qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention, qwen2.Qwen2MLP,
                             qwen2.Qwen2RMSNorm, qwen2.Qwen2RotaryEmbedding),
}


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take the lean forward (None: it can)."""
    if type(model) not in FAMILIES:
        return (f"{type(model).__name__} is not one of transformers' "
                f"{', '.join(kind.__name__ for kind in FAMILIES)}")
    if hasattr(model.lm_head, "_hf_hook"):
        return "the model carries accelerate hooks (device_map offloading)"
    return body_unsupported_reason(model.model, FAMILIES[type(model)])


def body_unsupported_reason(base: torch.nn.Module, family: tuple | None = None) -> str | None:
    """Why a model body (a causal LM's, or a draft head's ``LlamaModel``) cannot take the lean forward (None: it
    can). ``family``: the classes of :data:`FAMILIES` it must be made of (default: Llama's)."""
    body, decoder, attention, mlp, norm, rotary = family or FAMILIES[llama.LlamaForCausalLM]
    if type(base) is not body:
        return f"{type(base).__name__} is not transformers' {body.__name__}"
    if base.training:
        return "the model is in training mode"
    if any(kind != "full_attention" for kind in getattr(base.config, "layer_types", None) or ()):
        return "sliding-window attention layers"
    if body is mistral.MistralModel and base.config.sliding_window is not None:
        return "sliding-window attention layers"
    parts = [(base, body), (base.norm, norm), (base.rotary_emb, rotary)]
    for layer in base.layers[:base.config.num_hidden_layers]:
        parts += [(layer, decoder), (layer.self_attn, attention), (layer.mlp, mlp), (layer.input_layernorm, norm),
                  (layer.post_attention_layernorm, norm)]
    replaced = replaced_part(parts)
    if replaced is not None:
        return replaced
    if accelerate_hooked(base):
        return "the model carries accelerate hooks (device_map offloading)"
    if getattr(base.config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    return None


def replaced_part(parts: list[tuple[nn.Module, type]]) -> str | None:
    """Why the first ``(module, expected class)`` pair whose module is not exactly that class rules the lean forward
    out (None: every part is transformers' own): a subclass or a wrapper may compute something else."""
    for module, expected in parts:
        if type(module) is not expected:
            return f"{type(module).__name__} replaces transformers' {expected.__name__}"
    return None


def accelerate_hooked(module: nn.Module) -> bool:
    """Whether accelerate's offloading hooks sit on ``module`` or below it: they move weights in and out around a
    module's call, and the lean forward would bypass them on the modules it does not call."""
    return any(hasattr(part, "_hf_hook") for part in module.modules())


def compiled_forward_for(kind: type[LeanLlamaForward], model: torch.nn.Module) -> LeanLlamaForward | None:
    """A ``kind`` (a subclass for an architecture only the compiled layers take: Gemma-3, Qwen3) over ``model`` where
    its parts are ``kind``'s and its layers fit the compiled ones, else None (transformers' forward)."""
    if kind.unsupported_reason(model) is not None:
        return None
    lean = kind(model)
    return lean if lean.compiled is not None else None


def lean_forward_for(model: torch.nn.Module) -> LeanLlamaForward | None:
    """A :class:`LeanLlamaForward` over ``model``, or None where transformers' own forward must run."""
    return LeanLlamaForward(model) if unsupported_reason(model) is None else None


def transformers_forward(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache,
                         num_logits: int, hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict]:
    """``model``'s own forward with the lean forward's arguments and results: the logits of the last ``num_logits``
    rows and the hidden states of ``hidden_layers``; ``cache`` is updated in place."""
    # transformers reads logits_to_keep = 0 as "all of them": ask for one row and drop it instead.
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, past_key_values=cache,
                use_cache=True, logits_to_keep=max(num_logits, 1), output_hidden_states=bool(hidden_layers))
    logits = out.logits[:, out.logits.shape[1] - num_logits:]
    return logits, {layer: out.hidden_states[layer] for layer in hidden_layers}


def _linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; a plain ``nn.Linear`` without hooks skips ``Module.__call__`` (its forward is this very call)."""
    if type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks):
        return F.linear(x, module.weight, module.bias)
    return module(x)


def _rms_norm(norm: llama.LlamaRMSNorm, hidden: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``, operation for operation."""
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden.to(input_dtype)


@dataclass
class LeanCall:
    """The arguments of one :meth:`LeanLlamaForward.__call__`, for :meth:`LeanLlamaForward.forward_many`."""

    input_ids: torch.Tensor  # [1, n]
    position_ids: torch.Tensor  # [1, n]
    attention_mask: torch.Tensor | None
    cache: object
    num_logits: int
    hidden_layers: tuple[int, ...] = ()
    argmax_only: bool = False
    top_k_only: int = 0
    draws: object = None  # core.sampling.RowDraws: the rows' tokens drawn through the screened head
    allowed: torch.Tensor | None = None  # a grammar's allowed tokens per row of logits, for the screens

    @property
    def screen_rank(self) -> int:
        return DRAWN if self.draws is not None else screen_rank(self.argmax_only, self.top_k_only)


DRAWN = -1  # a head call's kind for rows drawn through the screen (core.sampling.RowDraws)


def screen_rank(argmax_only: bool, top_k_only: int) -> int:
    """What of each row's logits a forward's caller reads, as a screened head takes it: 1 the argmax alone (greedy), k
    the k largest (sampling with top-k), 0 all of them."""
    return 1 if argmax_only else top_k_only


class LeanLlamaForward:
    """``LlamaForCausalLM.forward`` for one sequence with a cache, as a plain function over the model's modules."""

    FAMILY_NAME = "Llama"
    unsupported_reason = staticmethod(unsupported_reason)
    # Whether attention_mass() reads this model's attention (its layers are Llama's).
    reads_attention = True
    # Whether greedy rows may read a screened head's argmax (kernels/grouped.py, ScreenedInt8Head).
    screens_head = True
    # The layer's norms the compiled layer takes: the attention block's input norm, then the MLP's.
    NORMS = ("input_layernorm", "post_attention_layernorm")
    # Whether a forward the compiled layers do not take may run Llama's operations below (decoder_layers); a subclass
    # whose layers add a step (Qwen3's q/k norms) runs transformers' own forward there instead.
    llama_operations = True

    def __init__(self, model: llama.LlamaForCausalLM) -> None:
        reason = self.unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lean forward needs transformers' {self.FAMILY_NAME} model: {reason}")
        self.model = model
        from jointspec.kernels.grouped import FusedCall

        # Per layer: one grouped-kernel call for q/k/v and one for gate/up where the int4 layers allow it (None
        # elsewhere); bit for bit the separate calls (kernels/grouped.py).
        self.fused = [(FusedCall.maybe(self._qkv(layer)), FusedCall.maybe(self._gate_up(layer)))
                      for layer in model.model.layers[:model.config.num_hidden_layers]]
        self.compiled = self._compiled_layers()
        self._set_prefill()

    def _set_prefill(self) -> None:
        model = self.model
        # How this forward reads a prompt: in chunks of ``prefill_chunk`` rows (None, or more: the caller's chunk),
        # those of ``prefill_gemm_rows`` rows or more with their projections as one GEMM. Fixed per model, so every
        # method reads a prompt into the same bits.
        # ``alone_prompt_tokens`` (only where ``prefill_gemm_rows`` is finite): a prompt's first that many positions
        # are read in chunks of ``prefill_gemm_rows`` - 1 rows, every row alone (ROWWISE_PROMPT_TOKENS), the rest in
        # chunks of ``prefill_chunk`` from there (CausalLM.prefill_chunk_end).
        self.prefill_chunk: int | None = None
        self.prefill_gemm_rows: float = PREFILL_GEMM_ROWS
        self.alone_prompt_tokens = 0
        if self.compiled is not None and self._isa in ("avx512vnni", "avx512"):
            self.prefill_chunk, self.prefill_gemm_rows = ROWWISE_PREFILL_CHUNK, math.inf
        elif self.compiled is not None:
            self.prefill_chunk = gemm_prefill_chunk(model.config.intermediate_size)
            if self._isa != "portable":
                self.prefill_gemm_rows = ROWWISE_PREFILL_CHUNK + 1
            if self._isa in ("avx2", "avx2vnni"):  # (measured on an AVX2-only CPU; the NEON builds were not)
                self.alone_prompt_tokens = ROWWISE_PROMPT_TOKENS

    def _compiled_layers(self) -> list[tuple] | None:
        """Per layer, the arguments of the compiled decoder layer (``decoder_layer`` in kernels/csrc) but the
        per-forward ones, where the whole model fits it: grouped 4-, 5-, 6- or 8-bit layers (with or without biases),
        row-wise attention, SiLU. None elsewhere. Also records, in ``self._compiled_checks``, every module,
        buffer and parameter they were read from, so that a later change to the model takes it off this path.

        A quantised model is its own model (kernels/quantize.py): the compiled layer computes what the operations
        below do, each row alone as they do, but not bit for bit (float sums in another order), so plain and
        speculative decoding of that model both run it, and agree exactly with each other."""
        from jointspec.kernels.grouped import kernel_arguments, kernels, selected_isa
        from jointspec.kernels.quantize import ROWWISE_ATTENTION

        config = self.model.config
        if config._attn_implementation != ROWWISE_ATTENTION or not self._activation_fits() or kernels() is None:
            return None
        base = self.model.model
        checks = [(base._modules, "layers", base.layers)]
        layers = []
        for index, (layer, (fused_qkv, fused_gate_up)) in enumerate(zip(base.layers, self.fused)):
            attn, mlp = layer.self_attn, layer.mlp
            plain = [attn.o_proj, mlp.down_proj]
            if not compiled_layer_fits(attn, plain + self._qkv(layer) + self._gate_up(layer)):
                return None
            # q | k | v and gate | up: one fused call where their buffers are stacked, else one part per layer.
            qkv = [list(fused_qkv.spans)] if fused_qkv else [kernel_arguments(m) for m in self._qkv(layer)]
            gate_up = ([list(fused_gate_up.spans)] if fused_gate_up
                       else [kernel_arguments(m) for m in self._gate_up(layer)])
            norms = [layer._modules[name] for name in self.NORMS] + self._head_norms(layer)
            if any(norm.weight.dtype != torch.float32 for norm in norms):
                return None
            checks.append((base.layers._modules, str(index), layer))
            for name in ("self_attn", "mlp", *self.NORMS):
                checks.append((layer._modules, name, layer._modules[name]))
            checks += [(attn._modules, name, attn._modules[name]) for name in self.HEAD_NORMS]
            for owner, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                 (mlp, ("gate_proj", "up_proj", "down_proj"))):
                for name in names:
                    module = owner._modules[name]
                    checks.append((owner._modules, name, module))
                    checks += [(module._buffers, buffer, module._buffers[buffer])
                               for buffer in (*module.BUFFERS, "bias")]
            checks += [(norm._parameters, "weight", norm.weight) for norm in norms]
            layers.append((self._norm_weight(norms[0]), self._norm_weight(norms[1]), self._norm_eps(norms[0]), qkv,
                           kernel_arguments(plain[0]), gate_up, kernel_arguments(plain[1]), config.num_attention_heads,
                           attn.scaling, config.num_key_value_heads, attn.head_dim))
        self._compiled_checks = tuple(map(list, zip(*checks)))  # owners, names, expected objects
        # A sample checked on every forward: the first and last layers' entries. Module._apply (to, float, cuda...)
        # writes every buffer straight into its module's dict, past the registration hooks; the sample sees it.
        sample = checks[1:COMPILED_SAMPLE + 1] + checks[-COMPILED_SAMPLE:]
        self._compiled_sample = tuple(map(list, zip(*sample)))
        self._verified_at: int | None = None  # the registration count at the last full check that passed
        # The same layers registered once in C++, so that a forward makes one call for all of them.
        self._isa = selected_isa()
        self._compiled_stack = kernels(self._isa).CompiledLayers()
        for norm1, norm2, eps, qkv, o_proj, gate_up, down, heads, scaling, _, _ in layers:
            self._compiled_stack.add_layer(norm1, norm2, eps, qkv, o_proj, gate_up, down, heads, scaling)
        for index, layer in enumerate(base.layers[:len(layers)]):
            self._add_extras(index, layer)
        self._compiled_buffers: list = []  # the cache buffers the stack was last given
        return layers

    def _ropes(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (cos, sin) pairs the compiled layers rotate by, each [1, n, head_dim] (Llama: one for every layer)."""
        return [self.model.model.rotary_emb(hidden, position_ids=position_ids)]

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return _rms_norm(self.model.model.norm, hidden)

    # Per-head norms of a layer's attention (Gemma-3's q_norm, k_norm), by attribute name: none in Llama.
    HEAD_NORMS: tuple[str, ...] = ()

    def _head_norms(self, layer) -> list[nn.Module]:
        return [layer.self_attn._modules[name] for name in self.HEAD_NORMS]

    def _activation_fits(self) -> bool:
        """Whether the MLP's activation is one the compiled layer computes."""
        return self.model.config.hidden_act == "silu"

    @staticmethod
    def _norm_weight(norm: nn.Module) -> torch.Tensor:
        """What the compiled layer multiplies a normed row by."""
        return norm.weight

    @staticmethod
    def _norm_eps(norm: nn.Module) -> float:
        return norm.variance_epsilon

    def _add_extras(self, index: int, layer) -> None:
        """Register what compiled layer ``index`` adds to Llama's (``CompiledLayers.set_extras``): nothing here."""

    def _compiled_ready(self, n: int, cache) -> bool:
        """Whether this forward (``n`` rows) can take the compiled layers: the model still holds what they were
        built from (:meth:`_compiled_model_ready`), a buffered cache, and a forward short enough for row-wise
        attention."""
        return self._compiled_model_ready() and self._compiled_call_ready(n, cache)

    def _compiled_model_ready(self) -> bool:
        """Whether the model still holds every module, buffer and parameter the compiled layers were built from, with
        row-wise attention still set.

        The full check is one identity test each (about 1,300 on SmolLM2; after a forward has streamed the weights
        through the caches it costs about half a millisecond, some 4 % of a step). It runs again only when a module,
        parameter or buffer has been registered anywhere since it last passed (:data:`_REGISTRATIONS`); every forward
        tests the first and last layers' entries, which catches ``Module._apply``. Not seen: a raw write into a
        middle layer's ``_modules``/``_buffers`` dict, or a ``del`` there.
        """
        from jointspec.kernels.quantize import ROWWISE_ATTENTION

        if self.compiled is None or self.model.config._attn_implementation != ROWWISE_ATTENTION:
            return False
        if not _still_held(self._compiled_sample):
            self._verified_at = None
            return False
        count = _REGISTRATIONS[0]
        if self._verified_at == count:
            return True
        ready = _still_held(self._compiled_checks)
        self._verified_at = count if ready else None
        return ready

    @staticmethod
    def _compiled_call_ready(n: int, cache) -> bool:
        """Whether one forward's rows (``n``) and cache fit the compiled layers."""
        from jointspec.backends.kvcache import BufferedLayer
        from jointspec.kernels.grouped import ROWWISE_MAX_ROWS

        return n <= ROWWISE_MAX_ROWS and all(type(layer) is BufferedLayer for layer in cache.layers)

    @staticmethod
    def _qkv(layer) -> list[nn.Module]:
        return [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]

    @staticmethod
    def _gate_up(layer) -> list[nn.Module]:
        return [layer.mlp.gate_proj, layer.mlp.up_proj]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 cache, num_logits: int, hidden_layers: tuple[int, ...] = (), argmax_only: bool = False,
                 top_k_only: int = 0, draws=None, allowed: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run ``input_ids`` ([1, n]) at ``position_ids`` ([1, n]) after ``cache`` (updated in place).

        ``attention_mask``: None (causal) or the 4-D mask transformers' mask builder accepts. Returns the logits of
        the last ``num_logits`` positions ([1, num_logits, vocab]; no LM head runs for 0) and, for each index in
        ``hidden_layers``, the hidden states transformers' ``output_hidden_states`` tuple has there ([1, n, hidden]):
        0 the embeddings, i the output of layer i - 1, -1 (and the last index) the final norm's output.
        ``argmax_only``: the caller reads only each row's argmax (greedy decoding), so a screened head
        (:class:`~jointspec.kernels.grouped.ScreenedInt8Head`) may give its screened logits; ``top_k_only`` (k > 0):
        it reads only each row's k largest logits (sampling with top-k), which the screen completes likewise.
        ``draws`` (:class:`~jointspec.core.sampling.RowDraws`): each row's token drawn through the screened head, the
        rows returned one-hot at the draws. ``allowed`` (bool [num_logits, vocab]; structured output): the screens find
        each row's best among its allowed tokens (the exact head ignores it: the caller masks its rows).
        """
        model = self.model
        base = model.model
        config = model.config
        inputs_embeds = base.embed_tokens(input_ids)
        hidden = inputs_embeds
        cos, sin = base.rotary_emb(hidden, position_ids=position_ids)
        num_layers = config.num_hidden_layers
        wanted = {layer % (num_layers + 1) for layer in hidden_layers}
        kept: dict[int, torch.Tensor] = {0: hidden} if 0 in wanted else {}
        batch_seq = hidden.shape[:-1]
        if batch_seq[0] == 1 and hidden.dtype == torch.float32 and self._compiled_ready(batch_seq[1], cache):
            # A forward that wants no logits is a prompt prefill (the decode loop's first forward): plain
            # and speculative decoding run the same one, and no later forward has to reproduce its rows one by one,
            # so where the GEMM is faster (prefill_gemm_rows) its projections take it: rows not computed alone.
            prefill = num_logits == 0 and batch_seq[1] >= self.prefill_gemm_rows
            segment = self._segment(inputs_embeds, position_ids, attention_mask, cache)
            hidden = self._compiled_body(hidden, [(cos, sin)], segment, wanted, kept, prefill)
        elif not self.llama_operations:
            return transformers_forward(model, input_ids, position_ids, attention_mask, cache, num_logits,
                                        hidden_layers)
        else:
            causal_mask = create_causal_mask(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                             past_key_values=cache, position_ids=position_ids)
            hidden = decoder_layers(base, hidden, cos, sin, causal_mask, cache, position_ids, wanted, kept, self.fused)
        hidden = _rms_norm(base.norm, hidden)
        if num_layers in wanted:
            kept[num_layers] = hidden
        if draws is not None and num_logits > 0:
            logits = self._drawn(hidden[0, -num_logits:], [draws], allowed)[None]
        else:
            logits = self._head(hidden, num_logits, screen_rank(argmax_only, top_k_only), allowed)
        return logits, {layer: kept[layer % (num_layers + 1)] for layer in hidden_layers}

    def forward_many(self, calls: list[LeanCall]) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]] | None:
        """Several sequences' forwards (each ``__call__``'s arguments, each with its own cache) in one pass of the
        compiled layers, or None where that path does not take them all (then call each alone).

        Each call's rows go through the operations ``__call__`` gives them when the call runs alone (the compiled
        layers and the head compute each row alone), so every call returns the same bits it would alone: a
        sequence decoded among others commits the tokens it commits by itself. The decoder weights are read once for
        every row of every sequence, which is what makes serving several requests together cheaper than one at a time.
        """
        model = self.model
        base, config = model.model, model.config
        # Where a prefill (no logits, many rows) takes the GEMM alone, its rows are not computed alone: not here. The
        # model is checked once for every call: they all run on it.
        if not calls or model.dtype != torch.float32 or not self._compiled_model_ready() or any(
                call.input_ids.shape[0] != 1 or not self._compiled_call_ready(call.input_ids.shape[1], call.cache)
                or (call.num_logits == 0 and call.input_ids.shape[1] >= self.prefill_gemm_rows)
                for call in calls):
            return None
        num_layers = config.num_hidden_layers
        embeds, ropes, visible, lengths, keys, values, starts = [], [], [], [], [], [], []
        for call in calls:
            hidden = base.embed_tokens(call.input_ids)  # [1, n, width]
            ropes.append(self._ropes(hidden, call.position_ids))
            views, (call_keys, call_values, start) = self._segment(hidden, call.position_ids, call.attention_mask,
                                                                   call.cache)
            embeds.append(hidden[0])
            visible.append([seen for seen, _ in views])
            lengths.append([count for _, count in views])
            keys.append(call_keys)
            values.append(call_values)
            starts.append(start)
        # Rotary pair r of every row, the sequences' rows one after another.
        cos, sin = ([torch.cat([pairs[r][part][0].float() for pairs in ropes]).contiguous()
                     for r in range(len(ropes[0]))] for part in (0, 1))
        wanted = sorted({layer % (num_layers + 1) for call in calls for layer in call.hidden_layers})
        keep = [layer for layer in wanted if 0 < layer < len(self.compiled)]
        rows, *outputs = self._compiled_stack.forward_many(
            torch.cat(embeds).contiguous(), [e.shape[0] for e in embeds], starts, visible, lengths, keys, values,
            cos, sin, keep)
        normed = self._final_norm(rows[None])  # [1, rows, width]: each row alone
        states, heads = [], []
        row = 0
        for call, embed in zip(calls, embeds):
            n = embed.shape[0]
            kept = {0: embed[None]} if 0 in wanted else {}
            kept.update({layer: output[None, row:row + n] for layer, output in zip(keep, outputs)})
            kept[num_layers] = normed[:, row:row + n]
            states.append({layer: kept[layer % (num_layers + 1)] for layer in call.hidden_layers})
            heads.append(normed[0, row + n - max(call.num_logits, 0):row + n])
            row += n
        # One head call per kind of head (screened argmax, screened top k or exact logits) over every call's rows:
        # the head's weights are the largest single read of a step, and it too computes each row alone. Up to
        # ROWWISE_MAX_ROWS rows a call: past that a quantised head takes a prompt's GEMM, whose rows are not computed
        # alone, and the calls' rows together may pass it where no call's own rows do.
        from jointspec.kernels.grouped import ROWWISE_MAX_ROWS

        logits: list[torch.Tensor | None] = [None] * len(calls)
        for rank in sorted({call.screen_rank for call in calls}):
            group = [i for i, call in enumerate(calls) if call.screen_rank == rank]
            allowed = (self._group_allowed([calls[i] for i in group], [len(heads[i]) for i in group])
                       if rank else None)  # the exact head's rows are masked by their callers
            if rank == DRAWN:  # every drawing call's rows in one screen pass, each row with its own key
                out = self._drawn(torch.cat([heads[i] for i in group]), [calls[i].draws for i in group], allowed)
            else:
                rows = torch.cat([heads[i] for i in group])
                pieces = zip(rows.split(ROWWISE_MAX_ROWS), allowed.split(ROWWISE_MAX_ROWS) if allowed is not None
                             else [None] * len(rows))
                out = torch.cat([self._head(piece[None], len(piece), rank, mask)[0] for piece, mask in pieces])
            start = 0
            for i in group:
                logits[i] = out[None, start:start + len(heads[i])]
                start += len(heads[i])
        return list(zip(logits, states))

    def _drawn(self, rows: torch.Tensor, draws: list, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """[n, width] final-normed rows -> [n, vocab] rows one-hot at each row's token drawn through the screened
        head, ``draws`` (RowDraws) giving the rows' keys and temperatures in order; ``allowed`` (bool [n, vocab] or
        None): a grammar's allowed tokens, the only ones drawn."""
        from jointspec.core.sampling import drawn_rows

        keys = torch.tensor([key for d in draws for key in d.keys], dtype=torch.long)
        temperature = torch.tensor([d.temperature for d in draws for _ in d.keys], dtype=torch.float32)
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} draw keys for {len(rows)} rows of logits")
        head = self.model.lm_head
        if not (self.screens_head and hasattr(head, "draw_tokens")):  # no screen to draw through: every logit
            return _linear(head, rows[None])[0].float()
        if allowed is not None:
            from jointspec.core.grammar import fit_width

            allowed = fit_width(allowed, head.out_features)
        tokens = head.draw_tokens(rows.contiguous(), temperature, keys, allowed=allowed)
        out = drawn_rows(tokens.clamp_min(0), head.out_features)
        # No number to draw from (a NaN row, or nothing allowed): its exact logits, as sampled (a caller masks them).
        broken = (tokens < 0).nonzero().flatten()
        if len(broken):
            out[broken] = _linear(head, rows[broken][None])[0].float()
        return out

    def _head(self, hidden: torch.Tensor, num_logits: int, screen: int,
              allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of the last ``num_logits`` rows of ``hidden`` ([1, n, width]); none for 0. ``screen``
        (:func:`screen_rank`): 1 where the caller reads each row's argmax alone, k its k largest logits, 0 all.
        ``allowed`` (bool [num_logits, vocab] or None): a grammar's allowed tokens, which a screen finds the best
        of; the exact head's rows are all given (the caller masks them)."""
        if num_logits <= 0:
            return hidden.new_zeros(hidden.shape[0], 0, self.model.config.vocab_size)
        from jointspec.kernels.grouped import SCREEN_TOP_K_MAX

        head, rows = self.model.lm_head, hidden[:, -num_logits:, :]
        if screen and self.screens_head and hasattr(head, "argmax_logits"):
            if allowed is not None:
                from jointspec.core.grammar import fit_width

                allowed = fit_width(allowed, head.out_features)
            if screen == 1:
                return head.argmax_logits(rows, allowed)
            if screen <= SCREEN_TOP_K_MAX:
                return head.top_k_logits(rows, screen, allowed)
        return _linear(head, rows)

    def _group_allowed(self, calls: list[LeanCall], counts: list[int]) -> torch.Tensor | None:
        """The allowed tokens of a screened head call over several calls' rows (``counts`` rows each), as wide as the
        head: each call's own, all for a call without a grammar; None where no call has one."""
        masks = [call.allowed for call in calls]
        if all(mask is None for mask in masks):
            return None
        width = self.model.lm_head.out_features
        from jointspec.core.grammar import fit_width

        return torch.cat([torch.ones(count, width, dtype=torch.bool) if mask is None else fit_width(mask, width)
                          for mask, count in zip(masks, counts)])

    def _segment(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache) -> tuple:
        """What the compiled layers need of one sequence's forward besides its rows: its views, each (visible,
        lengths) as their attention takes them (Llama: one), and each layer's cache slots for the new entries (the
        cache counts them from now)."""
        view = causal_view(self.model.config, inputs_embeds, position_ids, attention_mask, cache)
        return [view], self._slots(inputs_embeds, cache)

    def _slots(self, inputs_embeds: torch.Tensor, cache) -> tuple[list, list, int]:
        """The cache slots for the forward's new entries (the cache counts them from now): every layer's key buffer,
        every layer's value buffer ([kv_heads, capacity, head_dim], the same objects until they grow), and the index
        of the first new entry (:meth:`~jointspec.backends.kvcache.BufferedCache.append_rows`)."""
        kv_heads, head_dim = self.compiled[0][9], self.compiled[0][10]
        return cache.append_rows(inputs_embeds.shape[1], inputs_embeds.new_empty(1, kv_heads, 0, head_dim))

    def _compiled_body(self, hidden, ropes: list[tuple], segment: tuple, wanted, kept, prefill: bool) -> torch.Tensor:
        """The decoder layers as compiled calls (:meth:`_compiled_layers`), all in one; [1, n, width] in and out.
        ``ropes``: the (cos, sin) pairs the layers rotate by; ``segment``: :meth:`_segment` of this forward."""
        views, (keys, values, start) = segment
        cos = [c[0].float().contiguous() for c, _ in ropes]
        sin = [s[0].float().contiguous() for _, s in ropes]
        self._compiled_buffers = give_caches(self._compiled_stack, self._compiled_buffers, keys, values)
        keep = sorted(layer for layer in wanted if 0 < layer < len(self.compiled))
        rows, *outputs = self._compiled_stack.forward(hidden[0].contiguous(), start, [v for v, _ in views],
                                                      [length for _, length in views], cos, sin, prefill, keep)
        kept.update({layer: output[None] for layer, output in zip(keep, outputs)})
        return rows[None]


def compiled_layer_fits(attn, linears: list) -> bool:
    """Whether a decoder layer with attention ``attn`` and these linears fits the compiled decoder layer
    (``decoder_layer`` in kernels/csrc): its head width, and every linear a grouped int4/int8 layer."""
    from jointspec.kernels.grouped import GROUPED_LINEARS

    return not (attn.head_dim % 16 or attn.head_dim > 256) and all(type(m) in GROUPED_LINEARS for m in linears)


def causal_view(config, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache) -> tuple:
    """(visible, lengths): which keys each of a forward's rows sees, as the compiled attention takes them, for a model
    whose layers all attend alike (its ``config``), the rows fed after ``cache``."""
    from jointspec.kernels.quantize import compiled_visibility

    n = inputs_embeds.shape[1]
    # No mask given means causal, which the compiled attention takes as each row's number of keys.
    causal_mask = None if attention_mask is None else create_causal_mask(
        config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, past_key_values=cache,
        position_ids=position_ids)
    return compiled_visibility(causal_mask, cache.get_seq_length() + n, n)


def give_caches(stack, given: list, keys: list, values: list) -> list:
    """Hand a compiled stack a sequence's key and value buffers where they are not the ones it was ``given`` last
    (by identity: the cache keeps them until they grow); returns what it holds now."""
    buffers = keys + values
    if len(buffers) != len(given) or any(mine is not theirs for mine, theirs in zip(buffers, given)):
        stack.set_caches(keys, values)
        return buffers
    return given


def decoder_layers(base: llama.LlamaModel, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, causal_mask,
                   cache, position_ids: torch.Tensor, wanted: set[int] = frozenset(), kept: dict | None = None,
                   fused: list | None = None) -> torch.Tensor:
    """``base``'s decoder layers as transformers runs them, operation for operation; [batch, n, width] in and out.
    Outputs of the layers in ``wanted`` go into ``kept``; ``fused`` (per layer, the q/k/v and gate/up
    :class:`~jointspec.kernels.grouped.FusedCall` or None) runs those groups as one grouped-kernel call each."""
    config = base.config
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, llama.eager_attention_forward)
    num_layers = config.num_hidden_layers
    batch_seq = hidden.shape[:-1]
    for index, layer in enumerate(base.layers[:num_layers]):
        attn = layer.self_attn
        fused_qkv, fused_gate_up = fused[index] if fused is not None else (None, None)
        residual = hidden
        hidden = _rms_norm(layer.input_layernorm, hidden)
        shape = (*batch_seq, -1, attn.head_dim)
        qkv = LeanLlamaForward._qkv(layer)
        if fused_qkv is not None and fused_qkv.valid(qkv):
            query, key, value = fused_qkv(hidden)
        else:
            query, key, value = (_linear(projection, hidden) for projection in qkv)
        query = query.view(shape).transpose(1, 2)
        key = key.view(shape).transpose(1, 2)
        value = value.view(shape).transpose(1, 2)
        query, key = llama.apply_rotary_pos_emb(query, key, cos, sin)
        key, value = cache.update(key, value, attn.layer_idx)
        out, _ = attention(attn, query, key, value, causal_mask, dropout=0.0, scaling=attn.scaling,
                           position_ids=position_ids, use_cache=True)
        out = _linear(attn.o_proj, out.reshape(*batch_seq, -1).contiguous())
        hidden = residual + out
        residual = hidden
        hidden = _rms_norm(layer.post_attention_layernorm, hidden)
        mlp = layer.mlp
        gate_up = LeanLlamaForward._gate_up(layer)
        if fused_gate_up is not None and fused_gate_up.valid(gate_up):
            gate, up = fused_gate_up(hidden)
        else:
            gate, up = (_linear(projection, hidden) for projection in gate_up)
        hidden = residual + _linear(mlp.down_proj, mlp.act_fn(gate) * up)
        if index + 1 in wanted and index + 1 < num_layers:
            kept[index + 1] = hidden
    return hidden


class CompiledBody:
    """A draft head's ``LlamaModel`` body (drafts/eagle.py) on the compiled decoder layers: :func:`lean_body_forward`
    in one call to the kernels instead of a few dozen small ones. A head's draft step is one layer of a few million
    weights, where each separate kernel call's dispatch cost as much as its arithmetic (docs/kernels.md). Made by
    :meth:`maybe` where the body's linears are grouped int4/int8 layers, its norms float32 and its activation SiLU;
    a forward it does not take (more than ``ROWWISE_MAX_ROWS`` rows, a cache of other layers) runs
    :func:`lean_body_forward`. The results are the compiled layers' float rounding, not the operations' bit for bit:
    a draft's tokens, never what verification keeps."""

    def __init__(self, base: llama.LlamaModel, stack, kv_heads: int, head_dim: int) -> None:
        self.base = base
        self.stack = stack
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self._buffers: list = []  # the cache buffers the stack was last given

    @classmethod
    def maybe(cls, base: llama.LlamaModel) -> CompiledBody | None:
        """The compiled body of ``base``, or None where its layers do not fit the compiled decoder layer."""
        from jointspec.kernels.grouped import kernel_arguments, kernels, selected_isa

        config = base.config
        # The compiled layer's shapes (layer_weights in kernels/csrc): checked here, so that a head that does not fit
        # keeps the separate operations instead of failing at its first forward.
        if (body_unsupported_reason(base) is not None or config.hidden_act != "silu" or selected_isa() == "portable"
                or config.hidden_size % 64 or config.intermediate_size % 64 or kernels() is None):
            return None
        stack = kernels().CompiledLayers()
        for layer in base.layers[:config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if not compiled_layer_fits(attn, linears) or any(
                    norm.weight.dtype != torch.float32 or not norm.weight.is_contiguous() for norm in norms):
                return None
            q, k, v, o, gate, up, down = map(kernel_arguments, linears)
            stack.add_layer(norms[0].weight, norms[1].weight, norms[0].variance_epsilon, [q, k, v], o, [gate, up],
                            down, config.num_attention_heads, attn.scaling)
        return cls(base, stack, config.num_key_value_heads, base.layers[0].self_attn.head_dim)

    def __call__(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 cache) -> torch.Tensor:
        """:func:`lean_body_forward`'s arguments and result ([1, n, hidden] after the final norm)."""
        base = self.base
        n = inputs_embeds.shape[1]
        if inputs_embeds.dtype != torch.float32 or not LeanLlamaForward._compiled_call_ready(n, cache):
            return lean_body_forward(base, inputs_embeds, position_ids, attention_mask, cache)
        visible, lengths, keys, values, start, cos, sin = self._call_inputs(inputs_embeds, position_ids,
                                                                            attention_mask, cache)
        self._buffers = give_caches(self.stack, self._buffers, keys, values)
        rows = self.stack.forward(inputs_embeds[0].contiguous(), start, [visible], [lengths], [cos.contiguous()],
                                  [sin.contiguous()], False, [])[0]
        return _rms_norm(base.norm, rows[None])

    def _call_inputs(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None, cache):
        """What the compiled layers take for one call: the keys each row sees (visible, lengths), the cache rows it
        writes (keys, values, start) and its rotary tables (cos, sin, float32 [n, head_dim])."""
        visible, lengths = causal_view(self.base.config, inputs_embeds, position_ids, attention_mask, cache)
        keys, values, start = cache.append_rows(inputs_embeds.shape[1],
                                                inputs_embeds.new_empty(1, self.kv_heads, 0, self.head_dim))
        cos, sin = self.base.rotary_emb(inputs_embeds, position_ids=position_ids)
        return visible, lengths, keys, values, start, cos[0].float(), sin[0].float()

    def forward_many(self, inputs: list[torch.Tensor], positions: list[torch.Tensor],
                     caches: list) -> list[torch.Tensor] | None:
        """Several heads' chain forwards (each ``__call__``'s ``inputs_embeds`` [1, n, hidden] and ``position_ids``,
        causal, after its own ``cache``) in one pass of the layer's weights: ``[self(x, p, None, c)[0] ...]``, with the
        same bits, since the compiled layers compute each row alone. None, with no cache touched, where a call does
        not fit the compiled layers (then call each alone)."""
        base = self.base
        if any(x.dtype != torch.float32 or not LeanLlamaForward._compiled_call_ready(x.shape[1], cache)
               for x, cache in zip(inputs, caches)):
            return None
        visible, lengths, keys, values, starts, cos, sin = [], [], [], [], [], [], []
        for x, position_ids, cache in zip(inputs, positions, caches):
            seen, count, layer_keys, layer_values, start, c, s = self._call_inputs(x, position_ids, None, cache)
            visible.append([seen])
            lengths.append([count])
            keys.append(layer_keys)
            values.append(layer_values)
            starts.append(start)
            cos.append(c)
            sin.append(s)
        sizes = [x.shape[1] for x in inputs]
        rows = self.stack.forward_many(torch.cat([x[0] for x in inputs]).contiguous(), sizes, starts, visible,
                                       lengths, keys, values, [torch.cat(cos).contiguous()],
                                       [torch.cat(sin).contiguous()], [])[0]
        return list(_rms_norm(base.norm, rows[None])[0].split(sizes))


def lean_body_forward(base: llama.LlamaModel, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
    """``base(inputs_embeds=..., position_ids=..., attention_mask=..., past_key_values=cache,
    use_cache=True).last_hidden_state``, operation for operation, without transformers' per-module machinery: for
    draft heads whose body is a ``LlamaModel`` (drafts/eagle.py). Check :func:`body_unsupported_reason` first."""
    causal_mask = create_causal_mask(config=base.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                     past_key_values=cache, position_ids=position_ids)
    cos, sin = base.rotary_emb(inputs_embeds, position_ids=position_ids)
    hidden = decoder_layers(base, inputs_embeds, cos, sin, causal_mask, cache, position_ids)
    return _rms_norm(base.norm, hidden)


def attention_mass(base: llama.LlamaModel, layer_inputs: list[torch.Tensor], position_ids: torch.Tensor, cache,
                   start: int) -> torch.Tensor:
    """How much attention each query head of each layer pays each of the first ``start`` cached positions, from
    ``n`` rows that were just fed after them: [layers, heads, start], each row's softmax weights summed over the rows.

    ``layer_inputs[i]`` is layer i's input for those rows ([1, n, width]) and ``cache`` already holds their keys after
    the ``start`` earlier ones. Each row sees every earlier position and the rows before it, as a chain forward does.
    The queries are made again from the inputs by the layer's own norm, q projection and rotary embedding: the
    forward's queries, to float rounding where the compiled layers ran it. An estimate of which cached entries
    matter (drafters/speckv.py), not part of any forward."""
    n = layer_inputs[0].shape[1]
    cos, sin = base.rotary_emb(layer_inputs[0], position_ids=position_ids)
    causal = torch.ones(n, n, dtype=torch.bool, device=layer_inputs[0].device).tril()
    masses = []
    for index, layer in enumerate(base.layers[:base.config.num_hidden_layers]):
        attn = layer.self_attn
        query = _linear(attn.q_proj, _rms_norm(layer.input_layernorm, layer_inputs[index]))
        query = query.view(1, n, -1, attn.head_dim).transpose(1, 2)  # [1, heads, n, dim]
        query, _ = llama.apply_rotary_pos_emb(query, query, cos, sin)
        keys = cache.layers[index].keys[0, :, :start + n].float()  # [kv heads, start + n, dim]
        heads, kv_heads = query.shape[1], keys.shape[0]
        # Query heads share their group's key head: [kv heads, group * n, dim] against [kv heads, dim, keys].
        grouped = query[0].float().reshape(kv_heads, heads // kv_heads * n, attn.head_dim)
        scores = torch.matmul(grouped, keys.transpose(1, 2)).mul_(attn.scaling)
        scores = scores.view(heads, n, start + n)
        scores[:, :, start:].masked_fill_(~causal, float("-inf"))
        masses.append(torch.softmax(scores, dim=-1)[:, :, :start].sum(1))
    return torch.stack(masses)
