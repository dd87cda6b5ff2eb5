"""Faster float32 CPU kernels: oneDNN's packed linears, a weight-major GEMM for 2-4 rows, grouped-query attention.

PyTorch's CPU ``nn.Linear`` calls the BLAS it was built with (MKL in the official wheels). MKL's small-batch path for
``x @ W.T`` can read the weights once per row for 2 and 3 rows (cost ~ M x one step), which is exactly the forward
size short drafts are verified with. oneDNN's packed-weight kernel (``to_mkldnn``) makes the one-row product
cheaper, but its 2-5 row forwards still cost well over a step. The same product computed the other way round,
``(W @ x.T).T`` (:func:`weight_major_linear`: the weight is GEMM's left operand, streamed in its stored order against
2-4 input columns), costs about what one row does. So on the CPUs where ``auto`` picks these kernels
(:data:`ONEDNN_VENDORS`) the plain step is oneDNN's and verifying 1-3 draft tokens costs about one plain step. Past 4
columns MKL's weight-major kernel reads the weight again for every 4 columns, so oneDNN takes over from 5 rows on.
docs/kernels.md ("Measurements behind the kernel choices") has the timings, machines and commands behind each choice.

The weights are packed once (a second copy in oneDNN's blocked layout, next to the original ``weight``, which stays
the module's parameter: state dicts, tied embeddings, draft heads, quantisation and the weight-major path keep reading
it). Results differ from MKL's by float rounding only (max |logit difference| 8e-5 on the embedded model, the same
argmax at 300 of 300 positions). Speculative decoding is lossless against the target *as it runs*: plain decoding in
jointspec uses the same kernels, so ``ar`` and every exact method share them; ``stock_kernels`` switches a model back
to ``F.linear`` for a while (the benchmark runs transformers' own ``generate`` that way, so its rows stay stock
transformers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from jointspec.core.choices import KERNEL_CHOICES  # noqa: F401  (re-exported)
from jointspec.kernels.cpu import cpu_vendor

# Rows (tokens) up to which weight_major_linear beat oneDNN's packed kernel where tuned; see the module docstring.
WEIGHT_MAJOR_MAX_ROWS = 4


def weight_major_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``weight @ x.T``: the weight is the GEMM's left operand, streamed
    once in its stored row-major order against a few input columns. For 2-4 rows this was BLAS's fastest shape where
    these kernels were tuned (see the module docstring). An odd row count is padded with a zero row: MKL's 3-column
    kernel is slower than its 4-column one, and a padded column changes no other column's result."""
    rows = x.numel() // x.shape[-1]
    columns = x.reshape(rows, x.shape[-1])  # [rows, in]
    if rows % 2:
        columns = torch.cat([columns, columns.new_zeros(1, columns.shape[1])])
    # [out, rows] -> [rows, out]; contiguous, or every later view of it (heads, residual adds) pays for the strides.
    out = torch.mm(weight, columns.t()).t()[:rows].contiguous()
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class OneDNNLinear(nn.Module):
    """An ``nn.Linear`` (float32, CPU) computed by oneDNN with a packed copy of its weight (2-4 rows: by
    :func:`weight_major_linear`)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: tied weights stay tied
        self.bias = linear.bias
        self.packed_weight = linear.weight.detach().to_mkldnn()  # not a buffer: never saved, never copied
        self.stock = False  # True inside stock_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stock or x.dtype != torch.float32 or x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        rows = x.numel() // self.in_features
        if 2 <= rows <= WEIGHT_MAJOR_MAX_ROWS:
            return weight_major_linear(x, self.weight.detach(), bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.weight.device, dtype=self.weight.dtype)
        linear.weight = self.weight
        if self.bias is not None:
            linear.bias = self.bias
        return linear

    def __deepcopy__(self, memo):
        import copy

        # The packed oneDNN tensor has no storage to copy: copy the plain layer and pack the copy again.
        return OneDNNLinear(copy.deepcopy(self.to_linear(), memo))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def onednn_supported(model: nn.Module) -> str | None:
    """Why ``model`` cannot use oneDNN linears (None: it can)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    parameter = next(model.parameters(), None)
    if parameter is None:
        return "the model has no parameters"
    if parameter.device.type != "cpu":
        return f"oneDNN linears are for CPU models; this one is on {parameter.device}"
    if parameter.dtype != torch.float32:
        return f"oneDNN linears are used for float32 models; this one is {parameter.dtype}"
    return None


def _replace(model: nn.Module, wanted: type, build) -> int:
    replacements = [(parent, name, build(child)) for parent in model.modules()
                    for name, child in parent.named_children() if type(child) is wanted]
    # Replace after walking, so the walk never sees a half-rewritten tree.
    for parent, name, module in replacements:
        setattr(parent, name, module)
    return len(replacements)


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every plain float32 ``nn.Linear`` of a CPU model for :class:`OneDNNLinear`, in place; returns how many.

    Raises ``ValueError`` if the model cannot use them (see :func:`onednn_supported`). Quantised layers and other
    module types are left alone.
    """
    reason = onednn_supported(model)
    if reason:
        raise ValueError(reason)
    return _replace(model, nn.Linear, OneDNNLinear)


def use_stock_linears(model: nn.Module) -> int:
    """Undo :func:`use_onednn_linears` (in place); returns how many layers were switched back."""
    return _replace(model, OneDNNLinear, OneDNNLinear.to_linear)


def kernels_in_use(model) -> str:
    """``onednn`` if any linear layer of ``model`` currently runs on oneDNN, else ``stock`` ("" for what is not a
    torch module, e.g. a llama.cpp weights handle)."""
    if not isinstance(model, nn.Module):
        return ""
    return "onednn" if any(isinstance(m, OneDNNLinear) and not m.stock for m in model.modules()) else "stock"


# Where ``auto`` picks oneDNN: CPU vendors on which these kernels were measured faster than PyTorch's own. On the one
# other vendor measured they made a plain step slower and did not flatten verification, so elsewhere (other vendors
# included, unmeasured) PyTorch's own kernels are the safe choice; ``--kernels onednn`` still insists. The
# measurements: docs/kernels.md, "Where --kernels auto picks oneDNN".
ONEDNN_VENDORS = frozenset({"AuthenticAMD"})


def resolve_kernels(kernels: str, model: nn.Module) -> str:
    """``auto`` -> ``onednn`` where the model can use it (float32 on CPU) on a CPU where they were measured faster
    (:data:`ONEDNN_VENDORS`), else ``stock``; checks explicit choices."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernels '{kernels}'; choose one of: {', '.join(KERNEL_CHOICES)}")
    reason = onednn_supported(model)
    if kernels == "auto":
        return "onednn" if reason is None and cpu_vendor() in ONEDNN_VENDORS else "stock"
    if kernels == "onednn" and reason:
        raise ValueError(f"--kernels onednn: {reason}; use --kernels auto or stock")
    return kernels


@contextlib.contextmanager
def stock_kernels(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s oneDNN linears as plain ``F.linear``, and its attention as transformers' own ``sdpa``, inside
    the block (same weights, no copy)."""
    layers = [m for m in model.modules() if isinstance(m, OneDNNLinear) and not m.stock]
    for layer in layers:
        layer.stock = True
    gqa = use_stock_attention(model)
    try:
        yield
    finally:
        for layer in layers:
            layer.stock = False
        if gqa:
            model.set_attn_implementation(GQA_ATTENTION)


# Attention. transformers' ``sdpa`` attention runs grouped-query attention (fewer key/value heads than query heads,
# SmolLM2: 9 and 3) inside SDPA only when there is no mask; a forward of several new tokens after a cache always has
# one (a chain's causal mask, a tree's ancestor mask), and then it copies every key and value head once per query
# head it serves (``repeat_kv``: 2 copies of the whole cache per layer per verification). SDPA itself takes the
# grouping (``enable_gqa``) with a mask on CPU, bit for bit the same result, without the copies: multi-token forwards
# were measured faster with oneDNN's linears and with PyTorch's own, more so the longer the cache (one decode step has
# no mask and is unchanged; docs/kernels.md). So ``--kernels auto`` uses it on every CPU, whichever linears it picks.
GQA_ATTENTION = "jointspec_gqa_sdpa"


def gqa_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, except that a masked multi-token forward on CPU groups key/value heads in
    SDPA instead of copying them. Everything else (no mask, one query token, other devices, position biases,
    soft-capping, paged caches) goes to transformers' own function unchanged."""
    if (getattr(module, "num_key_value_groups", 1) == 1 or attention_mask is None or query.shape[2] == 1
            or query.device.type != "cpu" or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("cache") is not None
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)  # [batch, heads, q, head_dim]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_ATTENTION, gqa_sdpa_attention)
AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)  # the masks sdpa gets, unchanged


def attention_in_use(model) -> str:
    """The attention implementation a transformers model runs ("" for anything else)."""
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")


def use_gqa_attention(model: nn.Module) -> bool:
    """Switch a CPU transformers model on ``sdpa`` attention with grouped-query heads to :func:`gqa_sdpa_attention`;
    returns whether it did (other models are left alone)."""
    config = getattr(model, "config", None)
    parameter = next(model.parameters(), None)
    if (config is None or attention_in_use(model) != "sdpa" or parameter is None or parameter.device.type != "cpu"
            or not hasattr(model, "set_attn_implementation")):
        return False
    heads = getattr(config, "num_attention_heads", None)
    if heads is None or getattr(config, "num_key_value_heads", heads) == heads:
        return False
    model.set_attn_implementation(GQA_ATTENTION)
    return True


def use_stock_attention(model: nn.Module) -> bool:
    """Undo :func:`use_gqa_attention`; returns whether anything changed."""
    if attention_in_use(model) != GQA_ATTENTION:
        return False
    model.set_attn_implementation("sdpa")
    return True
