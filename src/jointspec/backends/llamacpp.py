"""A GGUF model run by llama.cpp (through ``llama-cpp-python``), behind the interface of :class:`CausalLM`.

The loop and the chain drafters only need ``forward`` / ``crop`` / ``keep`` / ``reset`` and a few sizes, so a
llama.cpp context can stand in for the torch adapter: same drafters, same verifiers, same loop. This matters on a
CPU, where llama.cpp's quantised kernels make one decode step several times cheaper than torch fp32.

How the interface maps onto llama.cpp's C API (the low-level bindings, not the ``Llama`` class: that class decodes
whole prompts with its own bookkeeping and copies logits of every position into a numpy array when asked for more
than the last one):

- ``forward(chain)`` is one ``llama_decode`` of one batch on sequence 0 at positions ``num_cached ...`` (split
  past ``n_batch`` tokens, and past ``EXACT_BATCH`` tokens when more than one row of logits is asked for, see
  below); only the rows asked for are flagged as outputs, so llama.cpp computes no logits for the others;
- ``crop(length)`` is ``llama_memory_seq_rm(seq 0, length, -1)``;
- ``keep(positions)`` accepts only a prefix (what the loop asks after a chain draft); trees are refused.

Tree drafts would need one llama.cpp sequence per branch (a token shared by several branches carries several
sequence ids) and a copy of the accepted branch back to sequence 0. Not done: on this backend each extra token in a
verify batch costs much more than in torch (k = 16 costs ~6x one step, see issue #7), so wide trees cannot pay.

Logits come back as fp32 ``[rows, vocab]`` torch tensors on the CPU. There are no hidden states
(``output_hidden=True`` is refused).

Flash attention is on by default, for exactness. Without it, llama.cpp's CPU attention uses other kernels for a
one-token batch than for a longer one, and on the embedded SmolLM2 (Q4_1, 30 layers) the logits of the same token at
the same position then differ by up to ~1 (of a ~20 range) between a single-token decode and a verify batch, at
some positions and not others (llama-cpp-python's ``Llama`` class shows exactly the same numbers). Greedy
speculation then drifts from plain greedy decoding at near-ties: on 2 grounded prompts x 64 tokens, one diverged at
its 6th token (top-two margin 0.04), for jointspec's ``pld`` and for llama-cpp-python's own prompt lookup alike.
With flash attention every query row is computed by the same kernel whatever the batch, and batched and
single-token logits were bit-identical for batches of 2 to 48 tokens after 0 to 400 cached tokens. From 64 tokens
on, llama.cpp switches matrix kernels and rows differ again (by up to 1.5), so a forward that returns more than one
row of logits (a verification) is fed in batches of at most ``EXACT_BATCH`` = 32 tokens; prefills (no logits, or
the last row only) keep whole ``n_batch`` batches, which are faster. ``flash_attn=False`` gives llama-cpp-python's
default back (the bench's ``llamacpp`` baselines use that default). llama.cpp's own loop prefills the whole prompt
in one batch while jointspec's loop prefills all but its last token, so even plain greedy outputs of the two can
part at a near-tie, with either setting.

A decode that verifies nothing (``ar``: the loop calls ``reset(plain=True)``) needs no batch invariance and runs on
a second context without flash attention, as llama.cpp's own loop does, since flash attention makes a step dearer
(docs/kernels.md, "llama.cpp"). Speculative methods are exact against greedy decoding on the flash-attention context,
so their output can part from ``ar``'s at a near-tie.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

from jointspec.core.draft import chain_parents
from jointspec.core.errors import ContextTooLongError, ModelLoadError, UnsupportedOptionError
from jointspec.core.target import ForwardOutput, TargetCapabilities
from jointspec.kernels.cpu import usable_cores
from jointspec.kernels.gguf_reader import shortfall_message

log = logging.getLogger(__name__)

INSTALL_HINT = ("the llama.cpp backend needs llama-cpp-python: pip install 'jointspec[llamacpp]' (it compiles "
                "llama.cpp from source, so a C++ compiler and CMake must be installed)")
TREE_ERROR = ("tree methods are not supported on the llama.cpp backend; use a chain method such as pld or sps")
DEFAULT_GGUF_LABEL = "SmolLM2-135M-Instruct Q4_1 (embedded default, llama.cpp)"
# Longest batch whose rows match single-token decoding bit for bit (with flash attention; module docstring).
EXACT_BATCH = 32


def import_llama_cpp():
    """The ``llama_cpp`` module, or :class:`ModelLoadError` saying how to install it."""
    try:
        import llama_cpp
    except ImportError as error:
        raise ModelLoadError(f"{INSTALL_HINT} ({error})") from error
    if not hasattr(llama_cpp, "llama_memory_seq_rm"):
        raise ModelLoadError(f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} is too old for jointspec "
                             "(no llama_memory_* API); pip install -U 'jointspec[llamacpp]'")
    return llama_cpp


_backend_ready = False


def _init_backend(llama_cpp) -> None:
    global _backend_ready
    if not _backend_ready:
        # llama.cpp logs every load to stderr; keep only errors unless the user configured the logger.
        lib_logger = logging.getLogger("llama-cpp-python")
        if lib_logger.level == logging.NOTSET:
            lib_logger.setLevel(logging.ERROR)
        import llama_cpp._logger  # noqa: F401  (installs the callback that routes llama.cpp logs to that logger)

        llama_cpp.llama_backend_init()
        _backend_ready = True


# llama.cpp's AMX matrix kernels, which it picks for quantised weights on CPUs with AMX, crash in llama-cpp-python
# 0.3.36: a segfault in the first decode of more than one token, in its own ``Llama`` class as in this adapter
# (llama.cpp issue #20824). Loading without llama.cpp's extra buffer types (no AMX, no repacked weights) avoids it; on
# other CPUs they stay on. Where it was seen, and how: docs/kernels.md, "llama.cpp".
def use_extra_buffer_types() -> bool:
    """Whether to load GGUF weights with llama.cpp's extra buffer types: not on CPUs with AMX (see above)."""
    from jointspec.kernels.cpu import cpu_flags

    return not any(flag.startswith("amx") for flag in cpu_flags())


def model_params(llama_cpp):
    """llama.cpp's default model parameters, with extra buffer types as :func:`use_extra_buffer_types` says."""
    return _with_extra_buffer_types(llama_cpp.llama_model_default_params())


_patch_lock = threading.Lock()


@contextlib.contextmanager
def llama_class_params():
    """While open, llama-cpp-python's ``Llama`` class loads models with :func:`model_params` (it has no argument for
    extra buffer types), so the bench's llama.cpp baselines run the same kernels as this adapter. One thread at a
    time: the patch is on the module."""
    import llama_cpp.llama_cpp as low_level

    with _patch_lock:
        default = low_level.llama_model_default_params
        low_level.llama_model_default_params = lambda: _with_extra_buffer_types(default())
        try:
            yield
        finally:
            low_level.llama_model_default_params = default


def _with_extra_buffer_types(params):
    if hasattr(params, "use_extra_bufts"):  # llama.cpp before mid 2025 had no such switch (nor the AMX crash)
        params.use_extra_bufts = use_extra_buffer_types()
    return params


class LlamaCppWeights:
    """A loaded GGUF model (weights and vocabulary), shared by every context made from it.

    This is what ``LlamaCppLM.model`` is: code that memoises per weights (the cost curve) treats a self-draft made
    by :meth:`LlamaCppLM.fork` as the same model, as it does for torch adapters sharing one module.
    """

    def __init__(self, path: Path) -> None:
        llama_cpp = import_llama_cpp()
        _init_backend(llama_cpp)
        self.path = path
        params = model_params(llama_cpp)
        self.extra_buffer_types = bool(getattr(params, "use_extra_bufts", True))
        pointer = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not pointer:
            short = shortfall_message(path)
            if short is not None:
                raise ModelLoadError(f"llama.cpp could not load {short}")
            raise ModelLoadError(f"llama.cpp could not load '{path}': not a GGUF model this llama.cpp build "
                                 "supports (set the 'llama-cpp-python' logger to INFO to see why)")
        self.pointer = pointer
        self._finalizer = weakref.finalize(self, llama_cpp.llama_model_free, pointer)
        self.vocab = llama_cpp.llama_model_get_vocab(pointer)
        self.num_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.context_length_trained = int(llama_cpp.llama_model_n_ctx_train(pointer))

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored in the GGUF (e.g. 'Ġthe' for byte-level BPE), as HF's tokens are."""
        import llama_cpp

        return llama_cpp.llama_vocab_get_text(self.vocab, token_id).decode("utf-8", errors="replace")


class _Context:
    """One llama.cpp context (one sequence's KV cache) and its batch buffer, freed with this object."""

    def __init__(self, llama_cpp, weights: LlamaCppWeights, *, n_ctx: int, n_threads: int, n_batch: int,
                 flash_attn: bool) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = min(n_batch, n_ctx)
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = n_threads
        if hasattr(params, "flash_attn_type"):
            params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                      else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        else:  # llama.cpp before the auto setting (mid 2025) had a plain flag
            params.flash_attn = flash_attn
        params.no_perf = True
        pointer = llama_cpp.llama_init_from_model(weights.pointer, params)
        if not pointer:
            raise ModelLoadError(f"llama.cpp could not create a context of {n_ctx} tokens for '{weights.path}' "
                                 "(out of memory?); pass a smaller n_ctx")
        self.pointer = pointer
        self.flash_attn = flash_attn
        self.memory = llama_cpp.llama_get_memory(pointer)
        self.max_context = int(llama_cpp.llama_n_ctx(pointer))
        self.n_batch = int(llama_cpp.llama_n_batch(pointer))
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        # The weights must outlive the context: the finalizer holds a reference to them.
        self._finalizer = weakref.finalize(self, _free_context, llama_cpp, pointer, self.batch, weights)


class LlamaCppLM:
    """A llama.cpp model over :class:`LlamaCppWeights`, holding one sequence's KV cache at a time.

    A :class:`~jointspec.core.target.TargetLM` for chain methods (``ar``, ``pld``, ``sps``, ``corpus``, ``hybrid``).
    ``model`` is the shared weights handle (no torch module: nothing here can run the model through torch);
    there is no ``config``.

    Two llama.cpp contexts may back it: the exact one (flash attention as ``flash_attn`` says, on by default: batched
    rows equal single-token rows, module docstring), which every decode that verifies uses; and, made on the first
    ``reset(plain=True)``, one with llama.cpp's default kernels (flash attention off) for decodes that feed one token
    at a time and verify nothing, where batch invariance buys nothing and flash attention makes a step dearer
    (docs/kernels.md, "llama.cpp"). ``plain`` says which one the current decode runs on.
    """

    def __init__(self, weights: LlamaCppWeights, *, n_ctx: int = 4096, n_threads: int | None = None,
                 n_batch: int = 512, flash_attn: bool = True, name: str | None = None) -> None:
        if n_ctx < 1 or n_batch < 1:
            raise ValueError(f"n_ctx and n_batch must be >= 1, got {n_ctx} and {n_batch}")
        llama_cpp = import_llama_cpp()
        self._lib = llama_cpp
        self.model = weights
        self.name = name or weights.path.name
        self.n_threads = n_threads or usable_cores()  # llama.cpp's own default, 4, oversubscribes small machines
        self.flash_attn = flash_attn
        self._exact = _Context(llama_cpp, weights, n_ctx=n_ctx, n_threads=self.n_threads, n_batch=n_batch,
                               flash_attn=flash_attn)
        self._fast: _Context | None = None if flash_attn else self._exact
        self._active = self._exact
        self.max_context = self._exact.max_context
        self.n_batch = self._exact.n_batch
        self.plain = False
        self.num_cached = 0

    # --- what the loop and drafters read -----------------------------------------------------------------------

    # Chains only, no hidden states, no torch module; a fork is a second llama.cpp context; ``plain`` decodes may run
    # on llama.cpp's default kernels (class docstring).
    capabilities = TargetCapabilities(fork=True, plain_decode=True, chains_only="llama.cpp's backend")

    @property
    def vocab_size(self) -> int:
        return self.model.num_vocab

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def set_threads(self, n_threads: int) -> None:
        """Threads for single-token and batch decoding alike."""
        if n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        self.n_threads = n_threads
        for context in (self._exact, self._fast):
            if context is not None:
                self._lib.llama_set_n_threads(context.pointer, n_threads, n_threads)

    def fork(self, name: str | None = None) -> LlamaCppLM:
        """A new context (own KV cache, same settings) over the same weights: a self-draft, a cost probe."""
        return LlamaCppLM(self.model, n_ctx=self.max_context, n_threads=self.n_threads, n_batch=self.n_batch,
                          flash_attn=self.flash_attn, name=name or f"{self.name} (fork)")

    def reset(self, *, plain: bool = False, length: int | None = None) -> None:
        """Empty the cache for a new sequence. ``plain=True``: this decode feeds one token at a time and verifies
        nothing, so it may run on llama.cpp's faster default kernels (class docstring). ``length`` changes nothing:
        llama.cpp's cache is allocated with its context."""
        if plain and self._fast is None:
            try:
                self._fast = _Context(self._lib, self.model, n_ctx=self.max_context, n_threads=self.n_threads,
                                      n_batch=self.n_batch, flash_attn=False)
            except ModelLoadError as error:  # a second KV cache did not fit: decode on the exact one, a bit slower
                log.warning("plain decoding stays on the flash-attention context: %s", error)
                self._fast = self._exact
        self._active = self._fast if plain else self._exact
        self.plain = plain
        self._lib.llama_memory_clear(self._active.memory, True)
        self.num_cached = 0

    def forward(self, token_ids: list[int] | torch.Tensor, *, parents: list[int] | None = None,
                num_logits: int | None = None, output_hidden: bool = False,
                argmax_only: bool = False, top_k_only: int = 0) -> ForwardOutput:
        """Feed ``token_ids`` (a chain) after the cache; they stay cached. Returns the last ``num_logits`` rows.
        ``argmax_only`` and ``top_k_only`` change nothing: llama.cpp has no screened head, so every row is exact
        anyway."""
        ids = [int(t) for t in (token_ids.reshape(-1).tolist() if isinstance(token_ids, torch.Tensor)
                                else token_ids)]
        n = len(ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if parents is not None and list(parents) != chain_parents(n):
            raise UnsupportedOptionError(TREE_ERROR)
        if output_hidden:
            raise UnsupportedOptionError("the llama.cpp backend returns no hidden states; methods that draft from "
                                         "the target's features need the torch backend")
        keep = n if num_logits is None else num_logits
        if not 0 <= keep <= n:
            raise ValueError(f"num_logits must be between 0 and {n}, got {num_logits}")
        if keep > 1 and self._active is not self._exact:
            raise RuntimeError("this decode was started with reset(plain=True), whose kernels give batched rows that "
                               "differ from single-token ones; reset() without plain=True to verify drafts")
        start = self.num_cached
        if start + n > self.max_context:
            raise ContextTooLongError(f"{start} cached + {n} new tokens exceed the llama.cpp context of "
                                      f"{self.max_context} tokens; load with a larger n_ctx")
        vocab = self.vocab_size
        logits = np.empty((keep, vocab), dtype=np.float32)  # [keep, vocab]
        filled = 0
        first_output = n - keep
        context = self._active
        batch = context.batch
        step = self.n_batch if keep <= 1 else min(self.n_batch, EXACT_BATCH)
        for chunk_start in range(0, n, step):
            chunk = ids[chunk_start:chunk_start + step]
            num_outputs = 0
            for i, token in enumerate(chunk):
                index = chunk_start + i
                batch.token[i] = token
                batch.pos[i] = start + index
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                wanted = index >= first_output
                batch.logits[i] = wanted
                num_outputs += wanted
            batch.n_tokens = len(chunk)
            status = self._lib.llama_decode(context.pointer, batch)
            if status != 0:
                # Whatever part of the batch was stored is dropped again, so the cache stays as before the call.
                self._lib.llama_memory_seq_rm(context.memory, 0, start, -1)
                raise RuntimeError(f"llama_decode failed with status {status} on {len(chunk)} tokens after "
                                   f"{start + chunk_start} cached (1: no KV slot, -1: invalid batch)")
            if num_outputs:
                # Outputs of this decode, in batch order: one contiguous [num_outputs, vocab] block.
                rows = np.ctypeslib.as_array(self._lib.llama_get_logits(context.pointer),
                                             shape=(num_outputs * vocab,))
                logits[filled:filled + num_outputs] = rows.reshape(num_outputs, vocab)
                filled += num_outputs
        assert filled == keep
        self.num_cached = start + n
        return ForwardOutput(logits=torch.from_numpy(logits), hidden=None)

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens."""
        if not 0 <= length <= self.num_cached:
            raise ValueError(f"cannot crop a cache of {self.num_cached} tokens to {length}")
        if length < self.num_cached:
            if not self._lib.llama_memory_seq_rm(self._active.memory, 0, length, -1):
                raise UnsupportedOptionError(
                    f"llama.cpp cannot roll back the memory of '{self.name}' (a recurrent or sliding-window "
                    "model?); speculative decoding on the llama.cpp backend needs a model with a plain KV cache")
            self.num_cached = length

    def keep(self, positions: list[int]) -> None:
        """Keep a prefix of the cache (the only case a chain draft produces); anything else is a tree."""
        if list(positions) != list(range(len(positions))):
            raise UnsupportedOptionError(f"{TREE_ERROR} (asked to keep cache positions {list(positions)[:8]}...)")
        self.crop(len(positions))


def _free_context(llama_cpp, context, batch, weights) -> None:
    # ``weights`` is only carried here so that the model is freed after its last context, never before.
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(context)


def check_vocabulary(weights: LlamaCppWeights, tokenizer, *, num_samples: int = 256) -> None:
    """Refuse a tokenizer whose ids do not mean llama.cpp's tokens: same size, same entry for sampled ids.

    Sampled: every special id, the first and last 64 ids, and ``num_samples`` ids spread over the vocabulary.
    Entries are compared as the vocabulary spells them (HF ``convert_ids_to_tokens`` vs llama.cpp's token text).
    """
    size = len(tokenizer)
    if size != weights.num_vocab:
        raise ModelLoadError(f"vocabulary mismatch: llama.cpp reads {weights.num_vocab} tokens from "
                             f"'{weights.path.name}' but the tokenizer has {size}; use the tokenizer made for this "
                             "GGUF file")
    ids = set(range(min(64, size))) | set(range(max(0, size - 64), size))
    ids |= set(range(0, size, max(1, size // num_samples)))
    ids |= {int(i) for i in getattr(tokenizer, "all_special_ids", []) if 0 <= int(i) < size}
    wrong = []
    for token_id in sorted(ids):
        ours, theirs = weights.token_text(token_id), tokenizer.convert_ids_to_tokens(token_id)
        if ours != theirs:
            wrong.append(f"id {token_id}: llama.cpp {ours!r} vs tokenizer {theirs!r}")
    if wrong:
        raise ModelLoadError(f"vocabulary mismatch between '{weights.path.name}' and its tokenizer on "
                             f"{len(wrong)} of {len(ids)} sampled ids ({'; '.join(wrong[:3])}); use the tokenizer "
                             "made for this GGUF file")


def resolve_gguf(source: str) -> tuple[Path, str, str]:
    """``default`` or a .gguf path -> (gguf file, tokenizer folder, label)."""
    from jointspec.backends import embedded

    if source == "default":
        gguf_path = embedded.default_gguf_path()
        return gguf_path, str(embedded.prepare_default_model()), DEFAULT_GGUF_LABEL
    path = Path(source).expanduser()
    if path.suffix != ".gguf":
        raise ModelLoadError(f"the llama.cpp backend loads GGUF files: pass 'default' or a path to a .gguf file, "
                             f"got '{source}'")
    if path.is_dir():
        raise ModelLoadError(f"'{source}' is a folder, not a GGUF file; pass the .gguf file itself, or 'default'")
    if not path.is_file():
        raise ModelLoadError(f"GGUF file '{source}' does not exist; check the path, or pass 'default'")
    return path, "", source


def load_llamacpp(source: str, *, n_threads: int | None = None, n_ctx: int = 8192, name: str | None = None,
                  flash_attn: bool = True) -> tuple[LlamaCppLM, object]:
    """Load ``source`` ('default' or a .gguf path) as (llama.cpp adapter, Hugging Face tokenizer).

    The context holds ``min(n_ctx, the model's trained context)`` tokens. ``n_threads`` defaults to the cores this
    process may use. ``flash_attn`` stays on for exact speculation (module docstring). Raises
    :class:`ModelLoadError` when llama-cpp-python is missing, the file does not load, or the tokenizer's vocabulary
    differs from llama.cpp's.
    """
    from transformers import AutoTokenizer

    import_llama_cpp()
    gguf_path, tokenizer_folder, label = resolve_gguf(source)
    try:
        if tokenizer_folder:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (OSError, ValueError, KeyError, struct.error) as error:  # struct.error: a file cut inside its metadata
        short = None if tokenizer_folder else shortfall_message(gguf_path)
        if short is not None:  # the file, not the tokenizer: say so
            raise ModelLoadError(f"could not load model '{source}': {short}") from error
        raise ModelLoadError(f"could not load the tokenizer of '{source}': {str(error).splitlines()[0]} (a GGUF file "
                             "cut short or damaged reads so; check its size against the original)") from error
    weights = LlamaCppWeights(gguf_path)
    check_vocabulary(weights, tokenizer)
    context = min(n_ctx, weights.context_length_trained) if weights.context_length_trained > 0 else n_ctx
    adapter = LlamaCppLM(weights, n_ctx=context, n_threads=n_threads, flash_attn=flash_attn, name=name or label)
    return adapter, tokenizer
