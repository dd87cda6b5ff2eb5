"""Method specs on the command line: ``name:key=value,...``, e.g. ``pld:n=4``, ``sps:draft=PATH,k=5``, ``mtad:tau=0.5``.

jointspec methods map their keys onto :class:`jointspec.methods.MethodConfig` fields (a few short aliases such as
``n``/``k`` for ``num_draft_tokens`` and ``tau`` for ``accept_threshold``); methods registered by other modules
work without changes here. ``hf-generate``, ``hf-assisted`` and ``hf-pld`` run transformers' own ``generate``;
``llamacpp`` and ``llamacpp-pld`` run llama-cpp-python's own generation loop (plain greedy, and its
``LlamaPromptLookupDecoding`` draft) on the GGUF. Any jointspec method takes ``backend=llamacpp`` to run on the
llama.cpp adapter instead of the torch target (``pld:backend=llamacpp``), and ``quantize=int8|int4`` to run on a
quantised copy of the torch target (``ar:quantize=int4``), so float, quantised and llama.cpp rows share one run;
``kernels=stock`` runs on a copy of the float target on PyTorch's own linear kernels instead of oneDNN (see
:mod:`jointspec.kernels.fp32`).

A list of specs is comma-separated too, so ``--methods ar,pld:n=4,max_ngram=2,hf-pld`` is read as
``ar`` | ``pld:n=4,max_ngram=2`` | ``hf-pld``: a piece with ``=`` and no ``:`` continues the previous spec's options,
and a bare number continues the previous value (``tree=4,2,2``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from jointspec.core.choices import BACKENDS, QUANTIZE_CHOICES
from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafters.approximate import ATTENTION_MODES
from jointspec.methods import MethodConfig, method_names, online_methods
from jointspec.methods.oracle import OracleConfig
from jointspec.methods.registry import NOT_BUILT, method_reads, unknown_method_error

# transformers' own generate, with the option keys each one accepts.
HF_METHODS: dict[str, tuple[str, ...]] = {
    "hf-generate": (),
    "hf-assisted": ("draft", "num_draft_tokens", "schedule", "confidence"),
    "hf-pld": ("num_draft_tokens", "max_ngram"),
}

ALIASES = {"n": "num_draft_tokens", "k": "num_draft_tokens", "gamma": "num_draft_tokens",
           "ngram": "max_ngram", "tau": "accept_threshold", "threshold": "accept_threshold",
           "beams": "beam_width", "corrupt": "corruption_rate", "corruption": "corruption_rate",
           "max_draft_tokens": "max_num_draft_tokens"}  # the last as the command line's --max-draft-tokens

# llama-cpp-python's own generation loop, with the option keys each one accepts: LlamaPromptLookupDecoding's
# constructor arguments (its defaults: max_ngram_size=2, num_pred_tokens=10), and flash_attn (default off, as
# llama-cpp-python's Llama class has it).
LLAMACPP_METHODS: dict[str, tuple[str, ...]] = {
    "llamacpp": ("flash_attn",),
    "llamacpp-pld": ("num_pred_tokens", "max_ngram_size", "flash_attn"),
}

# BACKENDS: where a jointspec method runs, the torch target (default) or the llama.cpp adapter over the GGUF.
# Spec keys that say where a jointspec method runs rather than how it drafts: no MethodConfig field reads them.
PLACEMENT_KEYS = ("backend", "quantize", "kernels", "attention", "memory", "kv")
# Linear-layer kernels of the torch target a method runs on: as loaded, or a copy on PyTorch's own F.linear.
SPEC_KERNELS = ("loaded", "stock")
# The torch target's attention after the prompt: the whole cache, or (lossy, for long inputs) part of it
# (drafters/approximate.py: with_attention).
SPEC_ATTENTION = ATTENTION_MODES
# Whether a method also drafts from its own earlier answers in this run (drafters/memory.py): online adaptation.
SPEC_MEMORY = ("off", "online")
# What the torch target's KV cache stores: as loaded (--kv-cache, which a quantize=auto copy's cache follows too),
# or float16 / float32 (a fork of the target over the same weights with that cache; hf.CausalLM.check_kv_dtype).
SPEC_KV = ("loaded", "float16", "float32")

# Method-specific config classes (a MethodConfig subclass adds that method's fields).
CONFIG_CLASSES: dict[str, type[MethodConfig]] = {"oracle": OracleConfig}


class MethodSpecError(UnsupportedOptionError):
    """A method spec names an unknown method or option, or gives a bad value."""


@dataclass(frozen=True)
class MethodSpec:
    label: str  # as written by the user; the name of the method in every report
    name: str
    options: dict[str, str] = field(default_factory=dict)  # canonical key -> value text

    @property
    def is_hf(self) -> bool:
        return self.name in HF_METHODS

    @property
    def is_llamacpp_reference(self) -> bool:
        """llama-cpp-python's own generation loop (``llamacpp``, ``llamacpp-pld``)."""
        return self.name in LLAMACPP_METHODS

    @property
    def backend(self) -> str:
        """Where a jointspec method runs: 'torch' or 'llamacpp'."""
        return self.options.get("backend", "torch")

    @property
    def quantize(self) -> str:
        """The torch target's quantisation for this method: 'none' (the bench's target as loaded), 'int8', 'int4', or
        'auto' (int4 where that recovers the model's own weights: backends.loading.resolve_quantize). ``default`` takes
        'auto' unless told otherwise, since it stands for what ``jointspec generate`` runs."""
        return self.options.get("quantize", "auto" if self.name == "default" else "none")

    @property
    def quantize_explicit(self) -> bool:
        """Whether this spec asks for a quantised copy by name (int8 / int4), not through 'auto'."""
        return self.options.get("quantize", "none") not in ("none", "auto")

    @property
    def kernels(self) -> str:
        """'loaded' (the bench's target as loaded, oneDNN linears on a float CPU model) or 'stock' (a copy of it on
        PyTorch's own ``F.linear``, to measure what the kernels give)."""
        return self.options.get("kernels", "loaded")

    @property
    def attention(self) -> str:
        """'full', or 'sparse' / 'speckv' / 'specpc': the target decodes over part of its cache, or reads part of a
        long prompt (lossy; long inputs)."""
        return self.options.get("attention", "full")

    @property
    def kv(self) -> str:
        """'loaded' (the target's cache as loaded) or 'float16' (a float16 cache over the same weights)."""
        return self.options.get("kv", "loaded")

    @property
    def memory(self) -> str:
        """'off', or 'online': the method drafts from its earlier answers in this run as well (online adaptation)."""
        return self.options.get("memory", "off")

    @property
    def needs_llamacpp(self) -> bool:
        return self.is_llamacpp_reference or self.backend == "llamacpp"


def all_method_names() -> list[str]:
    return sorted(set(method_names()) | set(HF_METHODS) | set(LLAMACPP_METHODS))


def split_specs(text: str) -> list[str]:
    """Split ``--methods`` text into one string per method (see the module docstring)."""
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        continues_options = specs and ":" in specs[-1] and ":" not in piece
        if continues_options and ("=" in piece or re.fullmatch(r"\d+", piece)):
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def parse_spec(text: str) -> MethodSpec:
    """``name:key=value,...`` -> MethodSpec with canonical keys; raises MethodSpecError naming what is valid."""
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    if name not in all_method_names():
        if name in NOT_BUILT:
            raise MethodSpecError(f"'{text}': {unknown_method_error(name)}")
        raise MethodSpecError(f"unknown method '{name}' in '{text}'; choose one of: {', '.join(all_method_names())}")
    valid = valid_keys(name)
    options: dict[str, str] = {}
    for item in split_items(rest):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not value.strip():
            raise MethodSpecError(f"option '{item}' in '{text}' must be key=value")
        key = ALIASES.get(key, key)
        if key not in valid:
            aliases = sorted(a for a, k in ALIASES.items() if k in valid)
            raise MethodSpecError(f"unknown option '{item.partition('=')[0]}' for method '{name}'; valid options: "
                                  f"{', '.join(valid) or '(none)'}" + (f" (aliases: {', '.join(aliases)})"
                                                                       if aliases else ""))
        options[key] = value.strip()
    if options.get("backend", "torch") not in BACKENDS:
        raise MethodSpecError(f"backend '{options['backend']}' in '{text}' must be one of: {', '.join(BACKENDS)}")
    if options.get("quantize", "none") not in QUANTIZE_CHOICES:
        raise MethodSpecError(f"quantize '{options['quantize']}' in '{text}' must be one of: "
                              f"{', '.join(QUANTIZE_CHOICES)}")
    if options.get("quantize", "none") not in ("none", "auto") and options.get("backend", "torch") != "torch":
        raise MethodSpecError(f"'{text}': quantize is for the torch backend; the llama.cpp backend runs the GGUF's "
                              "own quantisation")
    if options.get("kernels", "loaded") not in SPEC_KERNELS:
        raise MethodSpecError(f"kernels '{options['kernels']}' in '{text}' must be one of: {', '.join(SPEC_KERNELS)}")
    if options.get("kernels", "loaded") != "loaded" and (options.get("backend", "torch") != "torch"
                                                         or options.get("quantize", "none") not in ("none", "auto")):
        raise MethodSpecError(f"'{text}': kernels=stock is for the float torch target; drop backend/quantize")
    if options.get("attention", "full") not in SPEC_ATTENTION:
        raise MethodSpecError(f"attention '{options['attention']}' in '{text}' must be one of: "
                              f"{', '.join(SPEC_ATTENTION)}")
    if options.get("attention", "full") != "full" and options.get("backend", "torch") != "torch":
        raise MethodSpecError(f"'{text}': attention={options['attention']} is for the torch backend")
    if options.get("kv", "loaded") not in SPEC_KV:
        raise MethodSpecError(f"kv '{options['kv']}' in '{text}' must be one of: {', '.join(SPEC_KV)}")
    if options.get("kv", "loaded") != "loaded" and options.get("backend", "torch") != "torch":
        raise MethodSpecError(f"'{text}': kv={options['kv']} is for the torch backend (llama.cpp keeps its own cache)")
    if options.get("memory", "off") not in SPEC_MEMORY:
        raise MethodSpecError(f"memory '{options['memory']}' in '{text}' must be one of: {', '.join(SPEC_MEMORY)}")
    if options.get("memory", "off") != "off" and name not in online_methods():
        raise MethodSpecError(f"'{text}': method '{name}' does not draft from earlier answers; memory=online is for "
                              f"{', '.join(online_methods())}")
    return MethodSpec(label=text.strip(), name=name, options=options)


def split_items(rest: str) -> list[str]:
    """``n=4,tree=4,2,2`` -> ``['n=4', 'tree=4,2,2']``."""
    items: list[str] = []
    for piece in (p for p in rest.split(",") if p.strip()):
        if items and "=" not in piece:
            items[-1] += "," + piece
        else:
            items.append(piece)
    return items


def parse_specs(text: str) -> list[MethodSpec]:
    specs = [parse_spec(s) for s in split_specs(text)]
    if not specs:
        raise MethodSpecError("no methods given; pass e.g. --methods ar,pld")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise MethodSpecError(f"a method is listed twice in '{text}'")
    return specs


def config_class(name: str) -> type[MethodConfig]:
    return CONFIG_CLASSES.get(name, MethodConfig)


def valid_keys(name: str) -> list[str]:
    if name in HF_METHODS:
        return list(HF_METHODS[name])
    if name in LLAMACPP_METHODS:
        return list(LLAMACPP_METHODS[name])
    # A jointspec method's options are the settings it reads (a key it would ignore is refused with the valid ones).
    reads = method_reads(name)
    return [f.name for f in dataclasses.fields(config_class(name)) if f.name in reads] + list(PLACEMENT_KEYS)


def method_config(spec: MethodSpec, defaults: MethodConfig) -> MethodConfig:
    """The spec's MethodConfig: ``defaults`` (from the shared CLI options) overridden by the spec's options.

    llama.cpp reference engines read no MethodConfig: for them this only checks the spec's option values (so that
    callers validating every spec before loading a model catch theirs too) and returns ``defaults``.
    """
    if spec.is_llamacpp_reference:
        llamacpp_options(spec)
        return defaults
    cls = config_class(spec.name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    base = {name: getattr(defaults, name) for name in fields if hasattr(defaults, name)}
    base["name"] = spec.name
    for key, text in spec.options.items():
        if key in PLACEMENT_KEYS:  # where the method runs, not a method setting
            continue
        default = getattr(defaults, key, fields[key].default)
        if default is None and "tuple" in str(fields[key].type):  # e.g. tree: None means the method's own
            default = ()
        if default is None and "bool" in str(fields[key].type):  # e.g. cost_aware: None means the method's own
            default = False
        base[key] = convert(text, default, key, spec.label)
    try:
        return cls(**base)
    except (TypeError, ValueError) as error:
        raise MethodSpecError(f"bad options in '{spec.label}': {error}") from error


def convert(text: str, default: object, key: str, label: str) -> object:
    """Convert ``text`` to the type of the field's default value."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, tuple):
            return tuple(int(p) for p in re.split(r"[,x-]", text) if p)
    except ValueError:
        kind = "true/false" if isinstance(default, bool) else type(default).__name__
        raise MethodSpecError(f"option {key}='{text}' in '{label}' must be {kind}") from None
    return text


def llamacpp_options(spec: MethodSpec) -> dict[str, int | bool]:
    """A llama.cpp reference spec's options: ``flash_attn`` as a bool, the prompt-lookup sizes as integers >= 1."""
    values: dict[str, int | bool] = {}
    for key, text in spec.options.items():
        if key == "flash_attn":
            values[key] = convert(text, False, key, spec.label)
            continue
        values[key] = convert(text, 0, key, spec.label)
        if values[key] < 1:
            raise MethodSpecError(f"option {key}={values[key]} in '{spec.label}' must be >= 1")
    return values
