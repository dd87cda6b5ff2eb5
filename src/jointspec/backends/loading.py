"""Turning a model source string into a loaded Hugging Face model and tokenizer.

Sources, in the order they are tried:
- ``default`` (or nothing): the embedded SmolLM2-135M-Instruct, prepared once into a local cache;
- a ``.gguf`` file: with ``int4`` (what ``auto`` picks where the kernels take its blocks) built straight from its
  blocks (:func:`jointspec.kernels.gguf_blocks.model_from_blocks`), else loaded (dequantised) by transformers;
- a local folder with a ``config.json``;
- a hub id such as ``org/name``: only from this machine's Hugging Face cache, unless ``JOINTSPEC_ALLOW_DOWNLOAD=1``.

Two options change what runs the model. ``backend="torch"`` (the default) gives a :class:`CausalLM` over the
transformers model, optionally with its linear layers quantised (``quantize="int8"`` or ``"int4"``, see
:mod:`jointspec.kernels.quantize`). ``backend="llamacpp"`` runs a GGUF file (or the embedded default's original GGUF)
through llama.cpp (:mod:`jointspec.backends.llamacpp`), whose quantisation is the file's own.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import torch

from jointspec.backends import embedded
from jointspec.backends.hf import EXACT_HEAD_MODEL_TYPES, CausalLM
from jointspec.core.choices import BACKENDS, KV_CACHE_CHOICES, QUANTIZE_CHOICES
from jointspec.core.errors import ModelLoadError, UnsupportedOptionError
from jointspec.kernels.fp32 import (
    KERNEL_CHOICES,
    resolve_kernels,
    use_gqa_attention,
    use_onednn_linears,
    use_stock_attention,
    use_stock_linears,
)
from jointspec.kernels.gguf_blocks import shared_gguf_readers
from jointspec.kernels.heap import release_freed_memory
from jointspec.kernels.quantize import quantization_mode, quantize_model

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_LABEL = "SmolLM2-135M-Instruct (embedded default)"  # its name in the speed lines and reports
# QUANTIZE_CHOICES: ``auto`` is int4 where that is the model itself (:func:`resolve_quantize`), else none.
# KV_CACHE_CHOICES, what the target's KV cache stores: ``float32`` the model's dtype; ``float16`` half the memory and
# the bytes a long context's step reads (float32 models on jointspec's compiled CPU layers; CausalLM.check_kv_dtype);
# ``auto`` float16 where the model runs on those layers, else the model's dtype (auto_kv_dtype).
# A GGUF's projection weights (llama.cpp's names) and the quantisation types jointspec's grouped int4 mode recovers.
_GGUF_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def gguf_path(source: str | None) -> Path | None:
    """The GGUF file ``source`` is (the embedded default's own for ``default``), or None."""
    if source in (None, DEFAULT_MODEL):
        return embedded.default_gguf_path()
    path = Path(source).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def source_identity(source: str | None) -> str | None:
    """A local model's files as a string that changes when they do (path, size and modification time of the GGUF
    file or of each file in the folder); None for a hub id or what cannot be read."""
    try:
        if source in (None, DEFAULT_MODEL):
            # The converted folder the model is read from. Not gguf_path: that fetches the wheel when the cache holds
            # no copy of the GGUF, and an identity is no reason to download 93 MB (or to fail offline).
            path = embedded.default_model_dir()
        else:
            path = gguf_path(source) or Path(source).expanduser()
        files = sorted(path.iterdir()) if path.is_dir() else [path] if path.is_file() else []
        stats = [(str(file.resolve()), file.stat()) for file in files if file.is_file()]
    except (OSError, TypeError):
        return None
    return ";".join(f"{name}:{stat.st_size}:{stat.st_mtime_ns}" for name, stat in stats) or None


def gguf_block_types(source: str) -> dict[str, str] | None:
    """Tensor name -> GGUF type name for the projections and output head of the GGUF ``source`` (None: not a
    readable GGUF)."""
    path = Path(source).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return None
    try:
        from jointspec.kernels.gguf_blocks import gguf_reader

        types = {tensor.name: tensor.tensor_type.name for tensor in gguf_reader(path).tensors}
    except Exception as error:  # an unreadable file is load_model's to report; here it is just not on the grid
        log.debug("could not read the tensor types of %s: %s", path, error)
        return None
    head = "output.weight" if "output.weight" in types else "token_embd.weight"
    return {name: kind for name, kind in types.items()  # weights only: Qwen2's q/k/v biases are float32 in every file
            if name == head or (name.startswith("blk.") and name.endswith(".weight")
                                and name.split(".")[-2] in _GGUF_PROJECTIONS)}


def on_int4_grid(source: str) -> bool:
    """Whether ``source`` is a GGUF (or the embedded default, one) whose projections and output head are all stored
    in block types jointspec's grouped kernels take as they are (kernels/gguf_blocks.py, SUPPORTED_TYPES): then
    ``quantize="int4"`` runs the file's own weights, so the quantised model *is* the file's model (its inputs rounded
    to 8 bits by default, docs/kernels.md)."""
    if source == DEFAULT_MODEL:
        return True  # SmolLM2-135M-Instruct.Q4_1.gguf, checked by its SHA-256 (backends/embedded.py)
    from jointspec.kernels.gguf_blocks import SUPPORTED_TYPES

    types = gguf_block_types(source)
    return bool(types) and any(name.startswith("blk.") for name in types) and set(types.values()) <= set(
        SUPPORTED_TYPES)


def resolve_quantize(quantize: str, source: str | None, *, backend: str = "torch", device: str = "cpu",
                     dtype: str | torch.dtype | None = None, kernels: str = "auto") -> str:
    """``quantize`` with ``auto`` decided (:func:`quantize_choice`); other values are returned as given."""
    return quantize_choice(quantize, source, backend=backend, device=device, dtype=dtype, kernels=kernels)[0]


def quantize_choice(quantize: str, source: str | None, *, backend: str = "torch", device: str = "cpu",
                    dtype: str | torch.dtype | None = None, kernels: str = "auto") -> tuple[str, str]:
    """(mode, why) for ``quantize``. ``auto`` gives ``int4`` for a float32 torch model on a CPU that runs jointspec's
    grouped kernels with x86 vector instructions (avx512 or avx2) when the source is on their grid
    (:func:`on_int4_grid`: the same weights, a step about two thirds cheaper than float32's), else ``none`` (also for
    ``kernels="stock"``, which asks for transformers' own path). The ARM build (neondot), never measured on an ARM CPU
    here, is taken where a measurement on this CPU finds it faster (:mod:`jointspec.kernels.probe`); the portable
    build is exact too but slower than float32 where it was measured, so ``auto`` does not pick it; ``--quantize
    int4`` does."""
    if quantize != "auto":
        return quantize, "asked for"
    if backend != "torch":
        return "none", f"the {backend} backend runs the file's own weights"
    if kernels == "stock":
        return "none", "--kernels stock asks for transformers' own path"
    if torch.device(device).type != "cpu" or resolve_dtype(dtype, device) != torch.float32:
        return "none", "jointspec's int4 kernels are for float32 models on the CPU"
    if not on_int4_grid(source or DEFAULT_MODEL):
        from jointspec.kernels.gguf_blocks import SUPPORTED_TYPES

        return "none", (f"the model is not a GGUF whose projections and head are all in block types the kernels take "
                        f"as stored ({', '.join(SUPPORTED_TYPES)}): int4 would round its weights to other ones, "
                        "another model than its own (--quantize int4 to ask for it anyway)")
    from jointspec.kernels.grouped import AUTO_ISAS, selected_isa, unavailable_reason
    from jointspec.kernels.probe import PROBED_ISAS, int4_measured_faster

    isa = selected_isa()
    if isa not in AUTO_ISAS and isa not in PROBED_ISAS:  # (decided before the build: nothing to wait a minute for)
        return "none", ("jointspec's kernels run their portable build here (no AVX2 or ARM dot-product "
                        "instructions seen, or $JOINTSPEC_KERNEL_ISA), which is exact but slower than float32 where "
                        "it was measured")
    reason = unavailable_reason()
    if reason is not None:
        return "none", reason
    if isa in PROBED_ISAS:
        faster, why = int4_measured_faster(isa)
        if not faster:
            return "none", f"{why} (--quantize int4 runs them anyway)"
        return "int4", f"the file's own blocks on jointspec's {isa} kernels, the same weights: {why}"
    return "int4", f"the file's own blocks on jointspec's {isa} kernels: the same weights, the fastest exact path"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        # fp32 on CPU: bf16 is not faster on CPUs without AMX, and fp32 keeps greedy equivalence exact.
        return torch.float32 if device == "cpu" else torch.bfloat16
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ModelLoadError(f"unknown dtype '{dtype}'; choose one of: auto, {', '.join(table)}")
    return table[dtype]


def check_device(device: str) -> None:
    """Refuse a device torch cannot name or this machine does not have, before anything is loaded."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ModelLoadError(f"unknown device '{device}'; use cpu or cuda (cuda:N for a given GPU)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device '{device}' asked for, but CUDA is not available on this machine; use cpu")


def looks_like_path(source: str) -> bool:
    """Whether a model name is a local path (a hub id is 'org/name')."""
    return source.endswith(".gguf") or source.startswith((".", "/", "~")) or os.sep + os.sep in source


def check_model_path(source: str | None, option: str) -> None:
    """Refuse, before anything loads, a model or draft named by a path that does not exist (``option``: the flag or
    key that named it)."""
    if source and looks_like_path(source) and not Path(source).expanduser().exists():
        raise ModelLoadError(f"{option} '{source}' does not exist; check the path")


def check_load_options(source: str, *, device: str = "cpu", dtype: str | torch.dtype | None = None,
                       quantize: str = "none", backend: str = "torch", threads: int | None = None) -> None:
    """Refuse an unknown value or a combination that cannot work, before anything is loaded."""
    if backend not in BACKENDS:
        raise UnsupportedOptionError(f"unknown backend '{backend}'; choose one of: {', '.join(BACKENDS)}")
    if quantize not in QUANTIZE_CHOICES:
        raise UnsupportedOptionError(f"unknown quantisation '{quantize}'; choose one of: {', '.join(QUANTIZE_CHOICES)}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise UnsupportedOptionError(f"threads must be a whole number >= 1, got {threads!r}")
    if backend != "llamacpp":
        return
    if quantize not in ("none", "auto"):
        raise UnsupportedOptionError(
            f"quantize '{quantize}' (--quantize) is for the torch backend; the llama.cpp backend runs the GGUF "
            "file's own quantisation (pick a GGUF quantised as you want, e.g. Q4_1 or Q8_0), so drop it")
    if str(device).split(":")[0] != "cpu":
        raise UnsupportedOptionError(f"the llama.cpp backend runs on the CPU; drop device '{device}' (--device), "
                                     "or use the torch backend on the GPU")
    if dtype not in (None, "auto"):
        raise UnsupportedOptionError(f"dtype '{dtype}' (--dtype) is for the torch backend; the llama.cpp backend "
                                     "computes in the GGUF file's own types, so drop it")
    if source != DEFAULT_MODEL and not source.endswith(".gguf"):
        raise UnsupportedOptionError(f"the llama.cpp backend loads GGUF files: pass 'default' or a path to a .gguf "
                                     f"file, got '{source}' (or use the torch backend for this model)")


def load_model(source: str | None = DEFAULT_MODEL, *, device: str = "cpu", dtype: str | torch.dtype | None = None,
               name: str | None = None, quantize: str = "none", backend: str = "torch",
               threads: int | None = None, kernels: str = "auto", kv_cache: str = "auto") -> tuple[CausalLM, object]:
    """Load ``source`` as (adapter, tokenizer). Raises :class:`ModelLoadError` with what to do on failure.

    ``quantize``: ``none``, ``int8`` or ``int4`` (torch backend; applied after moving to ``device``), or ``auto``
    (:func:`resolve_quantize`: int4 where that is the source's own model, else none). ``backend``:
    ``torch`` or ``llamacpp`` (a :class:`~jointspec.backends.llamacpp.LlamaCppLM`, CPU only, ``dtype`` ignored).
    ``threads``: llama.cpp's thread count (default: the cores this process may use); the torch backend uses torch's
    process-wide setting, which the CLI sets from ``--threads``. ``kernels`` (torch backend): ``auto`` runs a float32
    CPU model's linear layers on oneDNN where that was measured faster (see :mod:`jointspec.kernels.fp32`) and
    its grouped-query attention without copying heads on any CPU, and a Llama model's forward through
    :mod:`jointspec.backends.lean_forward` (bit-identical, less overhead); ``onednn`` insists on oneDNN; ``stock`` keeps
    PyTorch's ``F.linear``, transformers' ``sdpa`` attention and transformers' own forward. ``kv_cache`` (torch
    backend): ``float32`` stores keys and values in the model's dtype, ``float16`` in half precision (needs the
    compiled CPU layers; exactness then holds against the same model with a float16 cache), ``auto`` in half
    precision where the model runs on the compiled CPU layers (:func:`auto_kv_dtype`), else in the model's dtype;
    llama.cpp keeps its own cache.
    """
    with shared_gguf_readers():  # one reader of a GGUF file for the whole load
        return _load_model(source, device=device, dtype=dtype, name=name, quantize=quantize, backend=backend,
                           threads=threads, kernels=kernels, kv_cache=kv_cache)


def _load_model(source: str | None, *, device: str, dtype: str | torch.dtype | None, name: str | None, quantize: str,
                backend: str, threads: int | None, kernels: str, kv_cache: str) -> tuple[CausalLM, object]:
    """:func:`load_model`, inside its shared GGUF readers."""
    if source is not None and (not isinstance(source, (str, os.PathLike)) or not str(source).strip()):
        raise ModelLoadError(f"the model must be a folder, a .gguf file or a model id (text), or None for the "
                             f"embedded default; got {source!r}")
    source = str(source) if source is not None else DEFAULT_MODEL
    if kernels not in KERNEL_CHOICES:
        raise UnsupportedOptionError(f"unknown kernels '{kernels}'; choose one of: {', '.join(KERNEL_CHOICES)}")
    if kv_cache not in KV_CACHE_CHOICES:
        raise UnsupportedOptionError(f"unknown kv cache '{kv_cache}'; choose one of: {', '.join(KV_CACHE_CHOICES)}")
    check_load_options(source, device=device, dtype=dtype, quantize=quantize, backend=backend, threads=threads)
    if backend == "llamacpp" and (kernels, kv_cache) != ("auto", "auto"):
        option, value = ("kernels", kernels) if kernels != "auto" else ("kv-cache", kv_cache)
        raise UnsupportedOptionError(f"--{option} {value} is for the torch backend; the llama.cpp backend runs "
                                     "llama.cpp's own kernels and cache, so drop it")
    check_device(device)
    if quantize == "auto" and backend == "torch" and source == DEFAULT_MODEL:
        # `auto` waits for the kernels' build to decide. On a first run the embedded model is fetched and converted
        # meanwhile, beside the build started ahead (grouped.prebuild); its weights are read after, as decided.
        embedded.prepare_default_model()  # (which keeps the GGUF too: an int4 load reads its blocks)
    quantize = resolve_quantize(quantize, source, backend=backend, device=device, dtype=dtype, kernels=kernels)
    if backend == "llamacpp":
        # Imported here: llama-cpp-python is optional, and only this backend needs it.
        from jointspec.backends.llamacpp import load_llamacpp

        return load_llamacpp(source, n_threads=threads, name=name)
    loaded = None
    if (quantize == "int4" and kernels != "stock" and gguf_path(source) is not None and device == "cpu"
            and resolve_dtype(dtype, device) == torch.float32):
        loaded = _load_gguf_blocks(source)
    if loaded is not None:
        model, tokenizer, label = loaded
    else:
        model, tokenizer, label = _load_transformers(source, device, dtype)
        if quantize != "none":
            quantize_model(model, quantize, file_levels=_file_levels(model, source, quantize),
                           screen_head=screens_head(model.config))
    if quantize != "none":
        label = f"{label} ({quantize})"
    try:
        if resolve_kernels(kernels, model) == "onednn":
            use_onednn_linears(model)
        if kernels != "stock":
            # Bit-identical to transformers' sdpa and cheaper to verify with on every CPU measured (docs/kernels.md).
            use_gqa_attention(model)
    except ValueError as error:
        raise UnsupportedOptionError(str(error)) from error
    release_freed_memory()  # the load's temporaries (kernels/heap.py)
    identity = source_identity(source)
    if identity is not None:  # what a measured cost curve may be kept under (drafters/curve_store.py)
        model.jointspec_identity = f"{identity}|{quantize}|{kernels}|{kv_cache}|{dtype}|{device}"
    # Where its weights came from: a quantised copy of a float model takes a GGUF's own blocks, as a load does.
    model.jointspec_source = source
    target = CausalLM(model, name=name or label, lean=kernels != "stock")
    kv_dtype = {"float16": torch.float16, "float32": None, "auto": auto_kv_dtype(target)}[kv_cache]
    if kv_dtype is not None:
        target.kv_dtype = kv_dtype
        target.check_kv_dtype()
        target.reset()
        if name is None:
            target.name = f"{label}, float16 KV cache"
    return target, tokenizer


def screens_head(config) -> bool:
    """Whether a quantised model of this config gets the 4-bit screen beside its 8-bit head: not where its forward
    reads the exact head for greedy rows (:data:`~jointspec.backends.hf.EXACT_HEAD_MODEL_TYPES`), which would only
    pay the screen's build (two passes over the dequantised head: seconds for a 150k-token vocabulary)."""
    return config.model_type not in EXACT_HEAD_MODEL_TYPES


def auto_kv_dtype(target: CausalLM) -> torch.dtype | None:
    """What ``--kv-cache auto`` stores keys and values in for ``target``: float16 where a float32 model runs on
    jointspec's compiled CPU layers, whose attention reads halves directly (as llama.cpp keeps its cache by default:
    half the memory, and at long inputs a cheaper step, since a step reads the whole cache), else None (the model's
    dtype). Exactness of every lossless method holds against plain decoding with the same cache."""
    if target.model.dtype == torch.float32 and target.lean is not None and target.lean.compiled is not None:
        return torch.float16
    return None


def _file_levels(model, source: str, quantize: str) -> dict | None:
    """For ``int4`` on a GGUF: the layers whose blocks jointspec's kernels take as they are (the rest are rounded,
    with one warning naming them and their types)."""
    path = gguf_path(source)
    if quantize != "int4" or path is None or not hasattr(model, "model") or not hasattr(model.model, "layers"):
        return None
    from jointspec.kernels.gguf_blocks import file_layers
    from jointspec.kernels.grouped import kernels

    if kernels() is None or next(model.parameters()).device.type != "cpu":
        return None
    found = file_layers(model, path)
    if found.left:
        log.warning("int4: %d layer(s) of %s are not in a block type jointspec's kernels take as stored, so they are "
                    "rounded to 4-bit groups (another model than the file's): %s", len(found.left), path.name,
                    "; ".join(found.left[:6]) + (" ..." if len(found.left) > 6 else ""))
    return found.layers


def quantized_copy(target: CausalLM, mode: str, kv_cache: str = "auto") -> CausalLM:
    """A copy of a float torch target with its linear layers quantised as ``mode`` (``int8`` / ``int4``) as
    :func:`load_model` quantises them (a GGUF's own blocks where the kernels take them), its cache as ``kv_cache`` says
    (``auto``: :func:`auto_kv_dtype`); the original stays as it is. For comparing float and quantised decoding in one
    process (the bench's ``quantize=`` option) without loading the model twice."""
    import copy

    if quantization_mode(target.model) != "none":
        raise UnsupportedOptionError(f"{target.name} is already quantised ({quantization_mode(target.model)}); "
                                     f"load it in float to compare it with {mode}")
    model = _unmarked(copy.deepcopy(target.model))
    # As load_model quantises: a GGUF's own blocks where the kernels take them (rounding its dequantised weights
    # again would be another model than `generate --quantize int4` runs), and the screened head.
    source = getattr(target.model, "jointspec_source", None)
    use_stock_linears(model)  # plain nn.Linear layers, as a load quantises them (oneDNN's are not matched to blocks)
    quantize_model(model, mode, file_levels=None if source is None else _file_levels(model, source, mode),
                   screen_head=screens_head(model.config))
    copied = CausalLM(model, name=f"{target.name} ({mode})", lean=target.lean is not None)
    copied.kv_dtype = {"float16": torch.float16, "float32": None, "auto": auto_kv_dtype(copied)}[kv_cache]
    copied.check_kv_dtype()
    copied.reset()
    return copied


def _unmarked(model):
    """A copy runs other kernels than the loaded model, so it does not keep its load identity (curve_store.py)."""
    model.__dict__.pop("jointspec_identity", None)
    return model


def stock_copy(target: CausalLM) -> CausalLM:
    """A copy of a torch target whose linear layers run PyTorch's own ``F.linear`` (no oneDNN), whose attention is
    transformers' own ``sdpa`` and whose forward is transformers' own (not :mod:`~jointspec.backends.lean_forward`), for
    comparing the kernels in one process (the bench's ``kernels=stock`` option)."""
    import copy

    model = _unmarked(copy.deepcopy(target.model))
    use_stock_linears(model)
    use_stock_attention(model)
    return CausalLM(model, name=f"{target.name} (stock kernels)", lean=False)


def _load_gguf_blocks(source: str):
    """(int4 model, tokenizer, label) for the GGUF file ``source``, or the embedded default's, built from its blocks
    without a float copy of its weights (:func:`jointspec.kernels.gguf_blocks.model_from_blocks`), or None where it
    cannot be, said once in the log (the caller then loads through transformers, as before). The embedded default
    takes its tokenizer and config from its converted folder, as its float32 load does, and not its float weights:
    read and dropped, they stayed resident beside the int4 model (docs/kernels.md, "GGUF block types")."""
    from transformers import AutoConfig, AutoTokenizer

    from jointspec.kernels.gguf_blocks import model_from_blocks

    path, label = gguf_path(source), source
    try:
        if source == DEFAULT_MODEL:
            folder, label = str(embedded.prepare_default_model()), DEFAULT_LABEL
            tokenizer, config = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, struct.error) as error:  # struct.error: a GGUF cut inside its metadata
        raise_if_cut_short(source, path, error)
        hint = " (a GGUF file cut short or damaged reads so)" if isinstance(error, struct.error) else ""
        raise ModelLoadError(f"could not load model '{source}': {_error_text(error)}{hint}") from error
    try:
        model, why = model_from_blocks(path, config, screen_head=screens_head(config))
    except (ValueError, KeyError) as error:  # a tensor not as its type says: transformers' loader says what
        model, why = None, str(error).splitlines()[0]
    if model is None:
        log.info("%s: loading through transformers (dequantised first), not from its blocks: %s", path.name, why)
        return None
    return model, tokenizer, label


def raise_if_cut_short(source: str, path: Path, error: Exception) -> None:
    """Where loading the GGUF file ``path`` failed because the file is shorter than its header says (an interrupted
    copy), raise that, not the reader's error about a shape or the tokenizer; else return."""
    from jointspec.kernels.gguf_reader import shortfall_message

    message = shortfall_message(path)
    if message is not None:
        raise ModelLoadError(f"could not load model '{source}': {message}") from error


def _in_hub_cache(repo_id: str) -> bool:
    """Whether this machine's Hugging Face cache holds a model's config under ``repo_id``."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - an id the hub cannot hold (HFValidationError and kin) is in no cache
        return False


def _error_text(error: Exception, limit: int = 400) -> str:
    """A library's error message on one line (transformers' run over several, and the first can end mid-sentence)."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


# The files a Hugging Face tokenizer loads its vocabulary from (fast, SentencePiece, byte-level BPE, WordPiece), and
# *.tiktoken (qwen.tiktoken and kin).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _load_transformers(source: str, device: str, dtype: str | torch.dtype | None):
    """(transformers model on ``device``, tokenizer, display label) for ``source``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype, device)
    kwargs: dict = {}
    if source == DEFAULT_MODEL:
        folder, label = str(embedded.prepare_default_model()), DEFAULT_LABEL
    else:
        path = Path(source).expanduser()
        label = source
        if path.is_file() and path.suffix == ".gguf":
            folder, kwargs["gguf_file"] = str(path.parent), path.name
        elif path.is_dir():
            if not (path / "config.json").is_file():
                inside = sorted(path.glob("*.gguf"))
                if inside:
                    raise ModelLoadError(f"model folder '{source}' has no config.json but holds {inside[0].name}: "
                                         f"pass the GGUF file itself (--model {path / inside[0].name})")
                raise ModelLoadError(f"model folder '{source}' has no config.json; pass a Hugging Face model folder, "
                                     "a .gguf file, or 'default'")
            folder = str(path)
        elif path.exists():
            raise ModelLoadError(f"model path '{source}' is a file but not a .gguf file; pass a Hugging Face model "
                                 "folder (the one holding config.json), a .gguf file, or 'default'")
        elif looks_like_path(source):
            raise ModelLoadError(f"model path '{source}' does not exist; check the path, or pass 'default' for the "
                                 "embedded SmolLM2")
        else:
            folder = source
            kwargs["local_files_only"] = os.environ.get("JOINTSPEC_ALLOW_DOWNLOAD") != "1"
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as error:
        if "gguf_file" in kwargs:
            raise_if_cut_short(source, Path(folder) / kwargs["gguf_file"], error)
        if kwargs.get("local_files_only") and not _in_hub_cache(source):
            # Neither a folder nor a cached hub id: what to do first, transformers' own words (about connecting to
            # the hub, which was not tried) after.
            where = (f"there is no folder '{source}' here, and as a hub id it is not in this machine's cache: check "
                     "the path" if "/" not in source else
                     f"'{source}' is not a folder here, and as a hub id it is not in this machine's cache")
            raise ModelLoadError(f"could not load model '{source}': {where}; hub ids load only from the cache, or set "
                                 f"JOINTSPEC_ALLOW_DOWNLOAD=1 to fetch (transformers: {_error_text(error)})"
                                 ) from error
        hint = (" (hub ids load only from this machine's cache; set JOINTSPEC_ALLOW_DOWNLOAD=1 to fetch)"
                if kwargs.get("local_files_only") else "")
        if Path(folder).is_dir() and "gguf_file" not in kwargs:
            if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES) and not any(
                    Path(folder).glob("*.tiktoken")):
                # transformers then says to install sentencepiece or tiktoken, which would not help
                raise ModelLoadError(f"model folder '{source}' has no tokenizer (no tokenizer.json, tokenizer.model "
                                     "or vocab.json beside its config.json); save the model's tokenizer there "
                                     "(tokenizer.save_pretrained(folder)) or copy its files from where the model came "
                                     "from") from error
            hint = (" (a model folder holds its tokenizer files and weights, *.safetensors or *.bin, beside "
                    "config.json)")
        if isinstance(error, struct.error):
            hint = " (a GGUF file cut short or damaged reads so; check its size against the original)"
        if isinstance(error, RuntimeError):
            if "size mismatch" not in str(error) and "mismatched" not in str(error):
                raise
            hint = (" (its tensors' shapes differ from the model transformers built from its metadata; transformers' "
                    "GGUF reader takes some sizes from defaults, such as Qwen3's 128-wide heads)")
        raise ModelLoadError(f"could not load model '{source}': {_error_text(error)}{hint}") from error
    model.to(device)
    return model, tokenizer, label
