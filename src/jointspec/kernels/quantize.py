"""Quantised linear layers for a Hugging Face causal LM: ``int8`` and ``int4``, chosen for fast CPU decoding.

A decode step of a small model is bound by reading its weights, so fewer bytes per weight means a cheaper step. Which
kernel to use was decided by timing PyTorch's own options, per layer and over the whole model; the tables (machine,
date, command) are in docs/kernels.md, "PyTorch's quantised kernels".

- **int8** = int8 weights (symmetric, one scale per output channel) times int8 activations quantised per token (one
  scale per row) on the fly, accumulated exactly in int32 by ``torch._int_mm`` (oneDNN VNNI on CPU). It was the
  fastest of PyTorch's options measured and its cost grows slowly with the number of tokens, which is what k-token
  verification needs. fbgemm's ``quantize_dynamic`` is as fast but quantises activations with *one scale for the whole
  batch*, so a token's result depends on the other tokens verified with it, and speculative decoding would stop being
  exactly plain decoding of the same quantised model. Per-token scales plus exact integer sums make every row's output
  independent of the batch (bit for bit, tested); with :func:`rowwise_sdpa` for attention, the whole forward is, which
  keeps greedy speculation lossless against the quantised target (13 of 13 prompts identical to ``ar`` for ``pld``,
  ``sps`` with a self-draft and transformers' ``generate``, where plain ``sdpa`` gave 5 of 13 in int4 and 2 of 13 in
  int8). torchao (0.18 installs beside torch 2.13 with ``--no-deps``) was slower on CPU without ``torch.compile`` and
  its CPU int4 is the same aten kernel in a prototype module, so it is not a dependency.
- **int4** = weight-only, 4-bit asymmetric groups of ``group_size`` inputs (scale and minimum per group). Where
  jointspec's kernels build (any CPU with a C++ compiler), groups of 32 run on jointspec's own kernel
  (:mod:`jointspec.kernels.grouped`: inputs rounded to 8 bits per group, as llama.cpp does, the
  head as 8-bit groups of 32 on the same kernel), which on the embedded model recovers the GGUF's own Q4_1 / Q8_0
  blocks: the file's weights. With float32 inputs (``JOINTSPEC_KERNEL_INPUTS=float``) that int4 copy is the float32
  model up to float rounding (1,024 of 1,024 teacher-forced argmaxes equal on 16 MT-Bench answers); with the default
  8-bit inputs 948 of 1,024 (docs/kernels.md, "8-bit inputs"). Where they cannot be built (no compiler or ninja),
  through ``_weight_int4pack_mm_for_cpu`` with
  bfloat16 activations (its fp16 and fp32 paths are scalar loops, far slower): about as fast as jointspec's kernel
  where both were timed, but bfloat16 activations cost agreement with the float32 model, and on some CPUs its cost
  grew about linearly with the number of tokens (docs/kernels.md). Rows are batch-independent in both.
- **LM head.** The head (49152 x 576 in SmolLM2) is a fifth of the weights and a large share of a decode step, so it
  is quantised too (``quantize_head=True``), and always as int8: in int4 it costs far more agreement than the whole
  body does (docs/kernels.md). SmolLM2 ties it to the input embedding: the head is replaced by a new module built from a
  *copy*, so the tie is broken and the embedding lookup stays in float (and keeps the float weights, which draft heads
  read, see ``eagle.float_lm_weight``). On jointspec's kernel the int8 head also keeps a 4-bit copy through which
  greedy decoding finds each row's argmax (:class:`~jointspec.kernels.grouped.ScreenedInt8Head`: exact int8 logits
  for every token within a few logits of the best 4-bit score; a cheaper greedy step); its logits, which
  sampling and perplexity read, are the int8 head's.
- Layers a kernel cannot take (int4: out_features not a multiple of 16 or in_features not a multiple of the group
  size) stay in float, with one warning naming them.

On the embedded SmolLM2 ``int4`` is both faster per step and closer to fp32 than ``int8`` (the GGUF's body already is
4-bit groups of 32, which ``int4`` recovers; ``int8``'s per-token activation scales suffer from SmolLM2's outlier
channels), and ``int8`` has the flatter cost curve; docs/kernels.md has the agreement of each choice with fp32. A model
that was not quantised before would rank them differently (``benchmarks/cost_curve.py`` measures both).

No on-disk cache: quantising is a few tensor passes over weights that are already in memory (under a second on the
135M default, less than loading the fp32 model takes), so storing a second copy of the model would cost more disk and
code than it saves. A model many times larger would want one.

CUDA: the same modules take the CUDA kernels when the weights are on a GPU (``_int_mm`` needs more than 16 rows there,
so inputs are padded; int4 uses ``_convert_weight_to_int4pack``). These paths have not been run: no GPU was available.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from jointspec.core.choices import QUANTIZE_MODES
from jointspec.kernels.fp32 import use_stock_attention, use_stock_linears
from jointspec.kernels.grouped import (
    ROWWISE_MAX_ROWS,
    GroupedInt4Linear,
    GroupedInt5Linear,
    GroupedInt6Linear,
    GroupedInt8Linear,
    ScreenedInt6Head,
    ScreenedInt8Head,
    grouped_misfit,
    kernels,
    stack_storage,
)
from jointspec.kernels.heap import release_freed_memory

log = logging.getLogger(__name__)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what both int4 kernels accept
DEFAULT_GROUP_SIZE = 32  # 576 (SmolLM2's hidden size) is not a multiple of 128; 32 is the most accurate of the rest
_TINY = 1e-12  # floor for scales, so an all-zero row or group quantises to zeros instead of dividing by zero


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with int8 ``W`` (one scale per output row) and ``x`` quantised to int8 per token.

    Row ``i`` of the output depends only on row ``i`` of the input: the activation scale is per row and the int32
    sums are exact, so verifying k tokens at once gives bit-identical results to feeding them one by one.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scale = weight.abs().amax(dim=1).clamp_min(_TINY) / 127  # [out]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).to(torch.int8))  # [out, in]
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight [out, in]: code that reads ``.weight.shape`` works, code that wants floats sees ints."""
        return self.qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in]
        rows = x.reshape(-1, self.in_features).float()  # [m, in]
        num_rows = rows.shape[0]
        x_scale = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True).clamp_min_(_TINY).div_(127)
        x_int8 = torch.round(rows / x_scale).to(torch.int8)  # |rows / x_scale| <= 127 by construction
        if x_int8.is_cuda and num_rows <= 16:  # the CUDA kernel wants more than 16 rows; zero rows change nothing
            x_int8 = torch.cat([x_int8, x_int8.new_zeros(17 - num_rows, self.in_features)])
        sums = torch._int_mm(x_int8, self.qweight.t())[:num_rows]  # [m, out] int32, exact
        out = torch.mul(sums, x_scale).mul_(self.scale)  # [m, out] float32
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights and activations"


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` in 4-bit asymmetric groups of ``group_size`` inputs; ``x`` in bfloat16."""

    def __init__(self, linear: nn.Linear, group_size: int) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        out_features, in_features = weight.shape
        groups = weight.reshape(out_features, in_features // group_size, group_size)
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        scale = ((high - low) / 15).clamp_min(_TINY)  # [out, groups, 1]
        levels = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
        # The kernels dequantise as (level - 8) * scale + zero, so the zero point is the group minimum shifted by 8.
        zero = low + 8 * scale
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        if weight.is_cuda:
            inner_k_tiles = next(t for t in (8, 4, 2) if in_features % (t * 16) == 0)
            pairs = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)  # [out, in / 2]
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
        self.register_buffer("packed", packed)
        # [groups, out, 2] bfloat16: the layout and dtype both kernels expect.
        self.register_buffer("scales_and_zeros",
                             torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    @property
    def weight(self) -> torch.Tensor:
        """A shape-only stand-in [out, in] (the packed layout is opaque), for code that reads ``.weight.shape``."""
        return torch.empty(self.out_features, self.in_features, dtype=torch.uint8, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in]
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [m, in]
        if rows.is_cuda:
            out = torch.ops.aten._weight_int4pack_mm(rows, self.packed, self.group_size, self.scales_and_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size,
                                                             self.scales_and_zeros)
        out = out.float()  # [m, out]
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 weights in groups of "
                f"{self.group_size}, bfloat16 activations")


ROWWISE_ATTENTION = "jointspec_rowwise"


def rowwise_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention that computes each query row alone, over exactly the keys it may see.

    PyTorch's CPU attention kernel rounds a row differently depending on how many rows and keys share the call (a
    lone decode row, or a row in a block of one or two, or a longer key span with the extra keys masked). In fp32 that
    moves logits by ~1e-7; a quantised model turns it into whole quantisation steps, enough to flip greedy near-ties,
    so a verified draft would not reproduce one-token-at-a-time decoding (measured: ``pld`` matched ``ar`` on 5 of 13
    prompts with int4). Here row ``i`` is one SDPA call on the first ``L_i`` keys: exactly the call that decoding
    that token alone makes, so the outputs are bit-identical. It costs one call per row: on SmolLM2-135M nothing
    measurable up to 4 rows, a growing share of the forward beyond (docs/kernels.md). Tree masks
    (non-prefix rows) gather the row's keys. Query shapes: [batch, heads, rows, dim]; keys and values
    [batch, kv_heads, keys, dim]; masks boolean or additive 0 / dtype-min. A batch of several sequences (the server's
    ragged engine: left padding and holes, masked) takes each sequence alone, its rows over the keys they see, so a
    sequence gets the bits it gets alone; long prefills keep transformers' one-call SDPA. Where jointspec's compiled
    kernels run (float32, kernels/grouped.py) one compiled call computes every row and head of a sequence the same
    way, each alone by construction.
    """
    batch, num_heads, num_rows, _ = query.shape
    if num_rows > ROWWISE_MAX_ROWS or dropout or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if batch > 1:  # the server's batches (padded, with holes): each sequence's rows alone, over the keys they see
        masks = [None] * batch if attention_mask is None else [
            attention_mask[b:b + 1] if attention_mask.shape[0] == batch else attention_mask for b in range(batch)]
        return torch.cat([rowwise_sdpa(module, query[b:b + 1], key[b:b + 1], value[b:b + 1], masks[b],
                                       scaling=scaling, is_causal=is_causal)[0] for b in range(batch)]), None
    num_keys = key.shape[2]
    compiled = _compiled_attention(query, key, value)
    if compiled is not None:
        visible, lengths = compiled_visibility(attention_mask, num_keys, num_rows)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return compiled.attention(query[0], key[0], value[0], visible, lengths, scale)[None], None
    visible = None
    if attention_mask is None:  # causal, the rows being the last ones (what transformers means by no mask)
        lengths = list(range(num_keys - num_rows + 1, num_keys + 1))
    else:
        visible = attention_mask[0, 0]  # [rows, keys]
        if visible.dtype != torch.bool:
            visible = visible > torch.finfo(visible.dtype).min / 2
        counts = visible.sum(dim=-1)  # [rows]
        if bool((visible == (torch.arange(num_keys, device=visible.device) < counts[:, None])).all()):
            lengths, visible = counts.tolist(), None  # every row sees a prefix of the keys: a chain
        else:
            lengths = counts.tolist()
    gqa = num_heads != key.shape[1]
    rows = []
    for row, length in enumerate(lengths):
        if visible is None:
            row_key, row_value = key[:, :, :length], value[:, :, :length]
        else:
            index = visible[row].nonzero()[:, 0]
            row_key, row_value = key.index_select(2, index), value.index_select(2, index)
        rows.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, row:row + 1], row_key, row_value, scale=scaling, enable_gqa=gqa))
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None  # [1, rows, heads, dim]


_NO_MASK = torch.empty(0, dtype=torch.bool)
_NO_LENGTHS = torch.empty(0, dtype=torch.long)


def compiled_visibility(attention_mask: torch.Tensor | None, num_keys: int, num_rows: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible, lengths) as jointspec's compiled attention takes them: for no mask (causal, the rows being the last
    ones) each row's number of keys, else the mask's [rows, keys] boolean matrix (an additive mask's finite
    entries), with the other one empty."""
    if attention_mask is None:
        return _NO_MASK, torch.arange(num_keys - num_rows + 1, num_keys + 1)
    visible = attention_mask[0, 0]
    if visible.dtype != torch.bool:
        visible = visible > torch.finfo(visible.dtype).min / 2
    return visible.contiguous(), _NO_LENGTHS


def _compiled_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """jointspec's compiled attention (kernels/csrc, with the grouped kernels) where it takes these tensors, else
    None. It computes each (row, head) pair alone by construction, so one call gives what one SDPA call per row
    does (the same property, not the same bits), for every row and head of a layer at once."""
    if query.device.type != "cpu" or {query.dtype, key.dtype, value.dtype} != {torch.float32}:
        return None
    if query.shape[-1] % 16 or query.shape[-1] > 256 or query.stride(-1) != 1 or any(
            t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] for t in (key, value)):
        return None

    return kernels()


AttentionInterface.register(ROWWISE_ATTENTION, rowwise_sdpa)
AttentionMaskInterface.register(ROWWISE_ATTENTION, sdpa_mask)  # the masks transformers builds for "sdpa"


def int4_misfit(linear: nn.Linear, group_size: int) -> str | None:
    """Why the int4 kernel cannot take ``linear`` (None if it can)."""
    out_features, in_features = linear.weight.shape
    multiple = 8 if linear.weight.is_cuda else 16
    if out_features % multiple:
        return f"out_features {out_features} is not a multiple of {multiple}"
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of the group size {group_size}"
    if linear.weight.is_cuda and in_features % 32:
        return f"in_features {in_features} is not a multiple of 32"
    return None


def int8_misfit(linear: nn.Linear) -> str | None:
    """Why the int8 kernel cannot take ``linear`` (None if it can; the CPU kernel takes any shape)."""
    out_features, in_features = linear.weight.shape
    if linear.weight.is_cuda and (out_features % 8 or in_features % 8):
        return f"shape {out_features}x{in_features} is not a multiple of 8 (CUDA int8 matmul)"
    return None


def _from_levels(stored, linear: nn.Linear, screen: bool) -> nn.Module:
    """A grouped layer holding a file's own levels (kernels/gguf_blocks.py) in place of ``linear``; an 8- or 6-bit
    head with ``screen``, screened (:class:`~jointspec.kernels.grouped.ScreenedInt8Head`, ``ScreenedInt6Head``)."""

    layer = stored.layer(None if linear.bias is None else linear.bias.detach())
    if screen and layer.bias is None and linear.in_features % 64 == 0:
        if type(layer) is GroupedInt8Linear:
            return ScreenedInt8Head.from_int8(layer)
        if type(layer) is GroupedInt6Linear:
            return ScreenedInt6Head.from_int6(layer)
    return layer


def quantization_mode(model: nn.Module) -> str:
    """``int4``, ``int8`` or ``none``: what :func:`quantize_model` did to ``model`` (int4 mode keeps an int8 head)."""

    kinds = {type(module) for module in model.modules()}
    if kinds & {Int4Linear, GroupedInt4Linear, GroupedInt5Linear}:
        return "int4"
    return ("int8" if kinds & {Int8Linear, GroupedInt6Linear, GroupedInt8Linear, ScreenedInt6Head, ScreenedInt8Head}
            else "none")


def quantize_model(model: nn.Module, mode: str, *, group_size: int = DEFAULT_GROUP_SIZE,
                   quantize_head: bool = True, screen_head: bool = True, file_levels: dict | None = None) -> nn.Module:
    """Replace ``model``'s ``nn.Linear`` layers by int8 or int4 ones, in place, and return the model.

    ``mode``: ``none`` (unchanged), ``int8`` or ``int4`` (see the module docstring). ``group_size`` (int4 only): inputs
    per scale, one of 32, 64, 128, 256. ``quantize_head``: also the output head, as int8 in both modes (untied from
    the input embedding, which stays float). ``screen_head`` (int4 on jointspec's kernel): the int8 head also keeps
    a 4-bit copy that greedy decoding reads its argmax through (:class:`~jointspec.kernels.grouped.ScreenedInt8Head`;
    its logits are unchanged). Quantise after moving the model to its device: the int4 packing differs
    between CPU and CUDA. Layers the kernel cannot take stay in float, logged as a warning. A model on ``sdpa``
    attention switches to :func:`rowwise_sdpa`, so that its rows stay independent of the batch in attention too.
    ``file_levels`` (int4 on jointspec's kernel): module name -> :class:`~jointspec.kernels.gguf_blocks.Levels`, the
    blocks a GGUF file stores for that layer, taken as they are (4-, 5- or 8-bit) instead of rounding the float
    weight. The dict is emptied once the layers hold them: the caller hands the levels over.
    """
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantisation mode '{mode}'; choose one of: {', '.join(QUANTIZE_MODES)}")
    if mode == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size}")
    if mode == "none":
        return model
    already = quantization_mode(model)
    if already != "none":
        raise ValueError(f"the model is already quantised ({already}); load it again in float to quantise it as "
                         f"{mode}")
    # oneDNN float layers (kernels.fp32) are plain linears underneath: quantise those. The CPU kernels' attention
    # goes back to sdpa too, so that the row-wise attention below replaces it (a copy of a float target has it).


    use_stock_linears(model)
    use_stock_attention(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # int4 in groups of 32 where jointspec's kernels build: its own kernel (kernels/grouped.py), weights read once per
    # forward whatever its rows; the head in 8-bit groups of 32 on the same kernel.
    grouped = (mode == "int4" and group_size == 32
               and any(type(m) is nn.Linear and grouped_misfit(m) is None for m in model.modules())
               and kernels() is not None)
    skipped: list[str] = []
    replacements: list[tuple[nn.Module, str, nn.Module]] = []
    # Weights this walk cannot reach (GPT-2's Conv1D, Falcon's Linear subclass, fused MoE experts), by module type:
    # a model mostly made of them is barely quantised, and says so below.
    others: dict[str, int] = {}
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for module in model.modules():
        if type(module) is nn.Linear or isinstance(module, nn.Embedding) or module is embeddings:
            continue
        weights = sum(p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2 and p.is_floating_point())
        if weights:
            others[type(module).__name__] = others.get(type(module).__name__, 0) + weights
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if type(child) is not nn.Linear or (child is head and not quantize_head):
                continue
            full_name = f"{parent_name}.{child_name}" if parent_name else child_name
            as_int8 = mode == "int8" or child is head
            if grouped and grouped_misfit(child) is None:
                stored = (file_levels or {}).get(full_name)
                if stored is not None:
                    quantized = _from_levels(stored, child, screen=child is head and screen_head)
                elif child is head and screen_head and child.bias is None and child.in_features % 64 == 0:
                    quantized = ScreenedInt8Head(child)
                else:
                    quantized = GroupedInt8Linear(child) if as_int8 else GroupedInt4Linear(child)
                replacements.append((parent, child_name, quantized))
                continue
            misfit = int8_misfit(child) if as_int8 else int4_misfit(child, group_size)
            if misfit:
                skipped.append(f"{full_name} ({misfit})")
                continue
            replacements.append((parent, child_name, Int8Linear(child) if as_int8 else Int4Linear(child, group_size)))
    quantized_weights = sum(child.weight.numel() for parent, name, _ in replacements
                            for child in [getattr(parent, name)])
    # Replace after walking, so the walk never sees a half-rewritten tree.
    for parent, child_name, quantized in replacements:
        setattr(parent, child_name, quantized)
    # The layers hold the levels now. Emptying the dict (not only dropping this name: the caller's call still holds the
    # dict until this returns) lets stacking below free each layer's first storage as it copies it, instead of keeping
    # the whole model twice until the end.
    replaced = len(replacements)
    if file_levels is not None:
        file_levels.clear()
    stored = file_levels = replacements = None
    # Layers that read the same input (attention's q/k/v, a gated MLP's gate/up) side by side in memory, so that the
    # lean forward can run each group as one grouped-kernel call (kernels/grouped.py, FusedCall).
    for module in model.modules():
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if all(hasattr(module, name) for name in names) and stack_storage([getattr(module, name)
                                                                                 for name in names]):
                # The separate buffers are free now, but a stacked copy does not fit in their holes, which glibc keeps
                # resident: 1.52 against 1.27 GB after stacking a 1B Q4_K_M model's layers (kernels/heap.py).
                release_freed_memory()
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(ROWWISE_ATTENTION)
    else:
        log.warning("%s: attention '%s' is not sdpa, so it stays as it is: verified drafts may then differ from "
                    "token-by-token decoding at near-ties (see rowwise_sdpa)", mode,
                    getattr(config, "_attn_implementation", None))
    if skipped:
        log.warning("%s: %d linear layer(s) left in float: %s", mode, len(skipped), "; ".join(skipped))
    if not replaced:
        log.warning("%s: no linear layer could be quantised; the model is unchanged", mode)
    elif others:
        share = sum(others.values()) / (sum(others.values()) + quantized_weights)
        if share > 0.1:
            log.warning("%s: %.0f%% of the model's weights are in layers other than torch's Linear (%s) and stay in "
                        "float: they run and weigh as float", mode, 100 * share, ", ".join(sorted(others)))
    return model
