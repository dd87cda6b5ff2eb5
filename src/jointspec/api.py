"""Text in, text out: prompts, chat templates, streaming detokenisation, timing.

The engine below works on token ids; this layer is the only one that touches tokenizers and text.
"""

from __future__ import annotations

import numbers
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from jointspec.backends.hf import CausalLM
from jointspec.backends.loading import DEFAULT_MODEL, check_load_options, load_model
from jointspec.backends.tokens import (
    IncrementalDetokenizer,
    chat_template_ids,
    check_template_kwargs,
    decode_text,
    eos_token_ids,
)
from jointspec.core.errors import JointspecError, UnsupportedOptionError
from jointspec.core.grammar import Grammar, OutputFormat, RecentGrammars
from jointspec.core.logprobs import TokenLogprob, check_top_logprobs, json_logprob
from jointspec.core.loop import DecodeConfig, SpecStats, SpeculativeDecoder
from jointspec.core.penalties import Penalties, checked_bias
from jointspec.core.sampling import SamplingConfig, fresh_seed
from jointspec.drafters.memory import OutputMemory
from jointspec.methods import MethodConfig, MethodContext, build_method, method_names
from jointspec.methods.registry import options_set, unknown_method_error, unread_options_error


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode one prompt: at most ``max_new_tokens`` new tokens; greedy at ``temperature`` 0 (the default),
    else sampled with that temperature and, where set, a ``top_k`` (0: none), a ``top_p`` (1: none) and a ``min_p``
    (0: none; tokens less than min_p times as likely as the most likely one are dropped, after the temperature).
    ``repetition_penalty``, ``presence_penalty`` and ``frequency_penalty`` (1, 0, 0: off) change each row's logits by
    the text before it, as vLLM applies them, greedy decoding included (:mod:`jointspec.core.penalties`);
    ``logit_bias`` (a mapping of token id to an amount in [-100, 100], kept as sorted pairs) adds a fixed amount to
    those tokens' logits before them, as OpenAI's ``logit_bias`` does.
    ``seed``: the sampled answer's seed, so a sampled call repeats its text (0 by default; None draws a fresh one each
    generation, which :attr:`GenerationResult.seed` reports), except with a method whose draft lengths follow
    measured timings (``sps``, ``hybrid``, ``mtad``, ``specinfer``, ``spectr`` unless ``cost_aware=False``;
    ``hybrid-tree``; ``default`` where it drafts its head's tree): its drafts draw from the same generator, so another
    length draws otherwise.
    ``chat``: wrap a text prompt in the model's chat template as one user message (where the tokenizer has one).
    ``chat_template_kwargs``: further variables for that template, as vLLM's ``chat_template_kwargs`` (Qwen3's
    ``{"enable_thinking": False}``).
    ``output_format``: what the answer must match (structured output: JSON of a schema, a regex, a Lark grammar;
    :class:`~jointspec.core.grammar.OutputFormat`), through any method. ``logprobs``: each new token's
    log-probability under the model (its raw distribution: temperature 1, before top-k, top-p and a grammar), with
    this many of the most likely tokens beside it (0 to 20; :attr:`GenerationResult.logprobs`); None: none."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    seed: int | None = 0  # None: a fresh seed each generation (a sampled answer is then not repeatable)
    chat: bool = True
    chat_template_kwargs: Mapping[str, object] | None = None
    output_format: OutputFormat | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k") + (("seed",) if self.seed is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # (numpy's ints are Integral)
                raise TypeError(f"{name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.chat, bool):
            raise TypeError(f"chat must be True or False, got {self.chat!r}")
        if self.chat_template_kwargs is not None:
            if not isinstance(self.chat_template_kwargs, Mapping):
                raise TypeError(f"chat_template_kwargs must be a mapping of names to values, got "
                                f"{type(self.chat_template_kwargs).__name__}")
            object.__setattr__(self, "chat_template_kwargs", check_template_kwargs(dict(self.chat_template_kwargs)))
        if self.output_format is not None and not isinstance(self.output_format, OutputFormat):
            raise TypeError(f"output_format must be an OutputFormat (e.g. OutputFormat.json_schema(schema)), got "
                            f"{type(self.output_format).__name__}")
        check_top_logprobs(self.logprobs)
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", int(self.logprobs))
        object.__setattr__(self, "logit_bias", checked_bias(self.logit_bias))
        _ = self.penalties  # building it validates the three penalties
        _ = self.sampling  # building it validates temperature / top-k / top-p

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.logit_bias)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p)


@dataclass
class GenerationResult:
    """One generation: its new ``text`` and ``token_ids`` (an end-of-sequence token included, where it ended on
    one), the ``prompt_ids`` decoded after, the decoding's wall-clock ``seconds`` (prompt reading included),
    ``finish_reason`` ("stop": an end-of-sequence token; "length": ``max_new_tokens`` or the context's end), the
    method's ``stats`` (rounds, drafted and accepted tokens, timings), the ``seed`` it sampled with, and where the
    config asked for them, each new token's ``logprobs`` (:class:`~jointspec.core.logprobs.TokenLogprob`)."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    seconds: float
    finish_reason: str  # "stop" (end-of-sequence token) or "length"
    stats: SpecStats = field(default_factory=SpecStats)
    seed: int | None = None  # the seed the generation used (GenerationConfig.seed, or the fresh one drawn for None)
    logprobs: list[TokenLogprob] | None = None  # one per token id, where GenerationConfig.logprobs asked for them

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "num_prompt_tokens": len(self.prompt_ids),
                "num_new_tokens": self.num_new_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_second": round(self.tokens_per_second, 3), "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict(),
                **({} if self.logprobs is None else {"logprobs": [
                    {"token_id": f.token_id, "logprob": json_logprob(f.logprob),
                     "top": [[token_id, json_logprob(value)] for token_id, value in f.top]} for f in self.logprobs]})}


def _checked_config(config) -> GenerationConfig:
    if not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig (e.g. GenerationConfig(max_new_tokens=64)), not "
                        f"{type(config).__name__}")
    return config


class _Session:
    """What every pipeline on one target shares: the target has one cache, so one generation at a time."""

    def __init__(self) -> None:
        # Held while a decoder runs a round, never while a caller holds a chunk. Reentrant: the cyclic garbage
        # collector may finalise a dropped stream (its finally takes the lock) inside a round of this thread.
        self.lock = threading.RLock()
        self.calls = threading.RLock()  # one generate_ids at a time (threads queue); a nested call ends the outer
        self.generation = 0  # which stream owns the target
        self.active: Iterator[list[int]] | None = None  # that stream's decoder generator, while unfinished


_SESSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SESSIONS_LOCK = threading.Lock()


def _session(target: CausalLM) -> _Session:
    """The session of the target whose cache ``target`` uses: a wrapper's (an approximate attention mode) is its
    inner target's. A target that cannot be weakly referenced gets a session of its own pipeline."""
    while getattr(target, "inner", None) is not None:
        target = target.inner
    with _SESSIONS_LOCK:
        try:
            session = _SESSIONS.get(target)
            if session is None:
                session = _SESSIONS[target] = _Session()
        except TypeError:  # not weakly referenceable or not hashable: nothing to share it by
            session = _Session()
        return session


def _checked_method(method: MethodConfig | str | None) -> MethodConfig:
    """``method`` as a MethodConfig (a name alone, as the CLI's --method; None: ``default``), refused where its name is
    not a method or it sets an option the method does not read (as generate and serve refuse it, not ignore it)."""
    if method is None:
        method = MethodConfig(name="default")
    elif isinstance(method, str):
        method = MethodConfig(name=method)
    elif not isinstance(method, MethodConfig):
        raise TypeError(f"method must be a MethodConfig or a method name, not {type(method).__name__}")
    if method.name not in method_names():
        raise UnsupportedOptionError(unknown_method_error(method.name))
    error = unread_options_error(method.name, options_set(method))
    if error:
        raise UnsupportedOptionError(error)
    return method


class Pipeline:
    """A target model, a decoding method and a tokenizer: ``generate`` text or ``stream`` it.

    One pipeline decodes one request at a time (one cache): ``generate`` calls from several threads run one after
    another, a stream started while another thread's ``generate`` runs waits for it, and a stream left open when
    another generation starts on the same pipeline is ended, its next read raising :class:`JointspecError`.
    Pipelines built on one loaded target share its cache, so they count as one here. Decode in parallel with one
    pipeline per thread, each on a target of its own (``jointspec serve`` batches requests on one model)."""

    def __init__(self, target: CausalLM, tokenizer, method: MethodConfig | None = None, *,
                 device: str = "cpu", dtype: str | None = None, quantize: str = "none", backend: str = "torch",
                 threads: int | None = None, kernels: str = "auto", kv_cache: str = "auto",
                 memory: OutputMemory | None = None) -> None:
        """``method``: by default ``default``, what ``jointspec generate`` runs. ``device``, ``dtype``,
        ``quantize``, ``backend``, ``threads``, ``kernels`` and ``kv_cache`` load the method's draft model, if any,
        the way :func:`load_model` loads a target. ``memory``: online adaptation, for the methods that learn online
        (:func:`jointspec.methods.online_methods`): every finished answer joins it, and later ones draft from it."""
        method = _checked_method(method)
        if not all(hasattr(target, name) for name in ("forward", "max_context")):
            raise TypeError(f"target must be a loaded target (jointspec.backends.hf.CausalLM(model), or what "
                            f"load_model or Pipeline.load gives), not {type(target).__name__}")
        if memory is not None and not isinstance(memory, OutputMemory):
            raise TypeError(f"memory must be an OutputMemory or None, not {type(memory).__name__}")
        self.target = target
        self.tokenizer = tokenizer
        self.method = method
        self.memory = memory
        self._session = _session(target)  # shared with every pipeline on this target: it has one cache

        def load_draft(source: str):
            return load_model(source, device=device, dtype=dtype, name=source, quantize=quantize, backend=backend,
                              threads=threads, kernels=kernels, kv_cache=kv_cache)

        drafter, verifier = build_method(MethodContext(self.method, target, tokenizer, load_draft, memory))
        self.decoder = SpeculativeDecoder(target, drafter, verifier)
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        self._grammars = RecentGrammars()  # output formats compiled for this tokenizer

    @classmethod
    def load(cls, model: str | None = DEFAULT_MODEL, method: MethodConfig | str | None = None, *, device: str = "cpu",
             dtype: str | None = None, quantize: str = "auto", backend: str = "torch",
             threads: int | None = None, kernels: str = "auto", kv_cache: str = "auto") -> Pipeline:
        """Load ``model`` and the method's draft (``method``: by default ``default``, as ``jointspec generate``)
        with the same options: ``quantize`` auto/none/int8/int4 (torch
        backend; auto, as ``jointspec generate``: int4 where that recovers the model's own weights, else none),
        ``backend`` torch/llamacpp, ``threads`` (llama.cpp's threads; on the torch backend PyTorch's, which is
        process-wide, as ``--threads`` sets it for the CLI; None: leave them as they are), ``kernels``
        auto/onednn/stock, ``kv_cache`` auto/float16 (see :func:`jointspec.backends.loading.load_model`)."""
        options = dict(device=device, dtype=dtype, quantize=quantize, backend=backend, threads=threads,
                       kernels=kernels, kv_cache=kv_cache)
        method = _checked_method(method)  # before the model loads: a misspelt method costs no load
        check_load_options(model, device=device, dtype=dtype, quantize=quantize, backend=backend, threads=threads)
        previous = torch.get_num_threads()
        if threads is not None and backend == "torch":  # (before the load: --quantize auto may time kernels there)
            torch.set_num_threads(threads)
        try:
            target, tokenizer = load_model(model, **options)
        except BaseException:
            torch.set_num_threads(previous)  # (a failed load leaves the process as it was)
            raise
        return cls(target, tokenizer, method, **options)

    def encode(self, prompt: str, chat: bool = True, template_kwargs: Mapping[str, object] | None = None) -> list[int]:
        """``prompt``'s token ids: in the chat template as one user message where ``chat`` and the tokenizer has one
        (``template_kwargs``: further variables for it), else the text as the tokenizer reads it."""
        if not isinstance(prompt, str):
            raise TypeError(f"the prompt must be text (str), not {type(prompt).__name__}; for token ids call "
                            "generate_ids() or stream_ids()")
        if self.tokenizer is None:
            raise JointspecError("this Pipeline has no tokenizer, so it cannot read text: pass token ids to "
                                 "generate_ids() or stream_ids(), or build it with the model's tokenizer")
        if chat and getattr(self.tokenizer, "chat_template", None):  # as `serve` reads a chat (text as text)
            return chat_template_ids(self.tokenizer, [{"role": "user", "content": prompt}],
                                     template_kwargs=template_kwargs)
        return self.tokenizer(prompt)["input_ids"]

    def _encode_for(self, prompt: str, config: GenerationConfig) -> list[int]:
        config = _checked_config(config)
        return self.encode(prompt, config.chat, config.chat_template_kwargs)

    def stream_ids(self, prompt_ids: Sequence[int] | torch.Tensor, config: GenerationConfig) -> Iterator[list[int]]:
        """Yield the new token ids as rounds commit them. A ``generate`` call running in another thread finishes
        first (the stream's first read waits for it); a stream still open when another generation starts is ended."""
        stream = self._stream(self._token_ids(prompt_ids), config)
        # Started under the calls' lock, never held across a yield: a stream's caller may keep it open for as long
        # as it likes, and a dropped one is finalised on whichever thread the collector runs.
        with self._session.calls:
            first = next(stream, None)
        if first is None:
            return
        yield first
        yield from stream

    def stream_logprobs(self, prompt_ids: Sequence[int] | torch.Tensor,
                        config: GenerationConfig) -> Iterator[list[TokenLogprob]]:
        """:meth:`stream_ids` with each new token's log-probability: yields, as rounds commit them, one
        :class:`~jointspec.core.logprobs.TokenLogprob` a token (its id, its figure, its row's ``config.logprobs`` most
        likely tokens), the figures :meth:`generate_ids` returns. ``config.logprobs`` must be set (0 for no
        alternatives)."""
        if _checked_config(config).logprobs is None:
            raise ValueError("stream_logprobs needs config.logprobs: 0 for each token's own figure, up to 20 for as "
                             "many of its row's most likely tokens beside it")
        seen = 0
        for chunk in self.stream_ids(prompt_ids, config):
            # (the decoder adds one figure per committed token as each round ends, before the round's tokens come out)
            figures = self.decoder.logprobs[seen:seen + len(chunk)]
            seen += len(chunk)
            yield list(figures)

    def _stream(self, prompt_ids: list[int], config: GenerationConfig) -> Iterator[list[int]]:
        """stream_ids on ids already checked (:meth:`_token_ids`)."""
        config = _checked_config(config)
        if not prompt_ids:  # e.g. an empty prompt without a chat template: a user error, not an engine one
            raise JointspecError("the prompt is empty after tokenisation; pass some text")
        penalties = config.penalties  # (built once: it checks its bias)
        penalties.check_vocab(self.target.vocab_size)  # a bias on a token the model lacks: refused by name
        seed = config.seed if config.seed is not None else fresh_seed()
        generator = torch.Generator(device="cpu").manual_seed(seed)
        decode = DecodeConfig(config.max_new_tokens, config.sampling, self.eos_token_ids,
                              self.grammar(config.output_format), logprobs=config.logprobs,
                              penalties=penalties)
        new_ids: list[int] = []
        session = self._session
        with session.lock:
            if session.active is not None:  # a stream left unfinished ends before this one starts (its drafter too)
                session.active.close()
            session.generation += 1
            mine = session.generation
            stream = session.active = self.decoder.stream(prompt_ids, decode, generator)
        try:
            while True:
                with session.lock:
                    if session.generation != mine:
                        raise JointspecError("another generation started on this Pipeline (or another one on the "
                                             "same model) while this stream was open, so it was ended; a model "
                                             "decodes one request at a time (use a Pipeline with its own model per "
                                             "thread, or finish a stream before starting another)")
                    try:
                        chunk = next(stream)
                    except StopIteration:
                        break
                new_ids.extend(chunk)
                yield chunk
        finally:  # finished, failed or dropped by its caller: a stream still owning the decoder ends now
            with session.lock:
                if session.generation == mine and session.active is stream:
                    stream.close()
                    session.active = None
        if self.memory is not None:  # a whole answer only: a stream its caller stopped early is not remembered
            self.memory.add(prompt_ids, new_ids)

    def grammar(self, output_format: OutputFormat | None) -> Grammar | None:
        """``output_format`` compiled for this pipeline's tokenizer (None for None); a format that cannot be used
        raises :class:`~jointspec.core.grammar.GrammarError` naming why."""
        if output_format is None:
            return None
        return self._grammars.get(output_format, lambda: Grammar(output_format, self.tokenizer, self.target.vocab_size,
                                                                 self.eos_token_ids))

    def _token_ids(self, prompt_ids) -> list[int]:
        """``prompt_ids`` as a list of ints inside the vocabulary (a list, tuple, 1-D tensor or array), else a clear
        error: they index the embedding table."""
        if isinstance(prompt_ids, (str, bytes)):
            raise TypeError("prompt_ids must be token ids (ints); for text, call generate() or stream()")
        if hasattr(prompt_ids, "tolist"):  # a tensor or an array
            prompt_ids = prompt_ids.tolist()
        ids = []
        for position, token in enumerate(prompt_ids):
            if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                raise TypeError(f"prompt_ids must be a flat sequence of ints; item {position} is {token!r}")
            ids.append(int(token))
        vocab = self.target.vocab_size
        outside = next((i for i, token in enumerate(ids) if not 0 <= token < vocab), None)
        if outside is not None:
            raise JointspecError(f"token id {ids[outside]} at position {outside} is outside the vocabulary [0, "
                                 f"{vocab})")
        return ids

    def stream(self, prompt: str, config: GenerationConfig = GenerationConfig()) -> Iterator[str]:
        """Yield text deltas as rounds commit tokens. (A stream reports no seed: to repeat a sampled stream, give
        ``config`` a seed; ``seed=None`` draws one that only :meth:`generate` reports.)"""
        detok = IncrementalDetokenizer(self.tokenizer)
        for chunk in self.stream_ids(self._encode_for(prompt, config), config):
            delta = detok.push(chunk)
            if delta:
                yield delta
        tail = detok.finish()  # the deltas then add up to what generate() returns as text
        if tail:
            yield tail

    def generate_ids(self, prompt_ids: list[int], config: GenerationConfig = GenerationConfig(),
                     on_text=None) -> GenerationResult:
        """Decode after ``prompt_ids``; ``on_text(delta)`` is called with streamed text if given."""
        if on_text is not None and not callable(on_text):
            raise TypeError(f"on_text must be a function of the text delta, not {type(on_text).__name__}")
        if on_text is not None and self.tokenizer is None:
            raise JointspecError("this Pipeline has no tokenizer, so it cannot give on_text the answer's text: build "
                                 "it with the model's tokenizer, or decode the returned token ids yourself")
        prompt_ids = self._token_ids(prompt_ids)
        config = _checked_config(config)
        seed = config.seed if config.seed is not None else fresh_seed()
        config = replace(config, seed=seed)  # the seed drawn for None, to report
        detok = IncrementalDetokenizer(self.tokenizer) if on_text is not None else None
        new_ids: list[int] = []
        with self._session.calls:
            start = time.perf_counter()
            for chunk in self._stream(prompt_ids, config):
                new_ids.extend(chunk)
                if detok is not None:
                    delta = detok.push(chunk)
                    if delta:
                        on_text(delta)
            seconds = time.perf_counter() - start
            stats = self.decoder.stats
            logprobs = list(self.decoder.logprobs) if config.logprobs is not None else None
        if detok is not None:
            tail = detok.finish()
            if tail:
                on_text(tail)
        finished = bool(new_ids) and new_ids[-1] in self.eos_token_ids
        text = decode_text(self.tokenizer, new_ids) if self.tokenizer is not None else ""
        return GenerationResult(text, new_ids, prompt_ids, seconds, "stop" if finished else "length", stats, seed,
                                logprobs)

    def generate(self, prompt: str, config: GenerationConfig = GenerationConfig(), on_text=None) -> GenerationResult:
        """Decode after ``prompt`` (text; in the model's chat template as one user message where ``config.chat``);
        ``on_text(delta)`` is called with the text as rounds commit it, if given."""
        return self.generate_ids(self._encode_for(prompt, config), config, on_text)
