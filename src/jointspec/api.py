"""Text in, text out: prompts, chat templates, streaming detokenisation, timing.

The engine below works on token ids; this layer is the only one that touches tokenizers and text.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from jointspec.backends.hf import CausalLM
from jointspec.backends.loading import DEFAULT_MODEL, load_model
from jointspec.backends.tokens import IncrementalDetokenizer, eos_token_ids
from jointspec.core.errors import JointspecError
from jointspec.core.loop import DecodeConfig, SpecStats, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.memory import OutputMemory
from jointspec.methods import MethodConfig, MethodContext, build_method


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _ = self.sampling  # building it validates temperature / top-k / top-p

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    seconds: float
    finish_reason: str  # "stop" (end-of-sequence token) or "length"
    stats: SpecStats = field(default_factory=SpecStats)

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
                "stats": self.stats.to_dict()}


class Pipeline:
    """A target model, a decoding method and a tokenizer: ``generate`` text or ``stream`` it."""

    def __init__(self, target: CausalLM, tokenizer, method: MethodConfig | None = None, *,
                 device: str = "cpu", dtype: str | None = None, quantize: str = "none", backend: str = "torch",
                 threads: int | None = None, kernels: str = "auto", kv_cache: str = "auto",
                 memory: OutputMemory | None = None) -> None:
        """``method``: by default ``default``, what ``jointspec generate`` runs. ``device``, ``dtype``,
        ``quantize``, ``backend``, ``threads``, ``kernels`` and ``kv_cache`` load the method's draft model, if any,
        the way :func:`load_model` loads a target. ``memory``: online adaptation, for the methods that learn online
        (:func:`jointspec.methods.online_methods`): every finished answer joins it, and later ones draft from it."""
        self.target = target
        self.tokenizer = tokenizer
        self.method = method or MethodConfig(name="default")
        self.memory = memory

        def load_draft(source: str):
            return load_model(source, device=device, dtype=dtype, name=source, quantize=quantize, backend=backend,
                              threads=threads, kernels=kernels, kv_cache=kv_cache)

        drafter, verifier = build_method(MethodContext(self.method, target, tokenizer, load_draft, memory))
        self.decoder = SpeculativeDecoder(target, drafter, verifier)
        self.eos_token_ids = eos_token_ids(target, tokenizer)

    @classmethod
    def load(cls, model: str | None = DEFAULT_MODEL, method: MethodConfig | None = None, *, device: str = "cpu",
             dtype: str | None = None, quantize: str = "auto", backend: str = "torch",
             threads: int | None = None, kernels: str = "auto", kv_cache: str = "auto") -> Pipeline:
        """Load ``model`` and the method's draft (``method``: by default ``default``, as ``jointspec generate``)
        with the same options: ``quantize`` auto/none/int8/int4 (torch
        backend; auto, as ``jointspec generate``: int4 where that recovers the model's own weights, else none),
        ``backend`` torch/llamacpp, ``threads`` for llama.cpp, ``kernels`` auto/onednn/stock, ``kv_cache``
        auto/float16 (see :func:`jointspec.backends.loading.load_model`)."""
        options = dict(device=device, dtype=dtype, quantize=quantize, backend=backend, threads=threads,
                       kernels=kernels, kv_cache=kv_cache)
        target, tokenizer = load_model(model, **options)
        return cls(target, tokenizer, method, **options)

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        if chat and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def stream_ids(self, prompt_ids: list[int], config: GenerationConfig) -> Iterator[list[int]]:
        if not prompt_ids:  # e.g. an empty prompt without a chat template: a user error, not an engine one
            raise JointspecError("the prompt is empty after tokenisation; pass some text")
        generator = torch.Generator(device="cpu").manual_seed(config.seed)
        decode = DecodeConfig(config.max_new_tokens, config.sampling, self.eos_token_ids)
        new_ids: list[int] = []
        for chunk in self.decoder.stream(prompt_ids, decode, generator):
            new_ids.extend(chunk)
            yield chunk
        if self.memory is not None:  # a whole answer only: a stream its caller stopped early is not remembered
            self.memory.add(prompt_ids, new_ids)

    def stream(self, prompt: str, config: GenerationConfig = GenerationConfig()) -> Iterator[str]:
        """Yield text deltas as rounds commit tokens."""
        detok = IncrementalDetokenizer(self.tokenizer)
        for chunk in self.stream_ids(self.encode(prompt, config.chat), config):
            delta = detok.push(chunk)
            if delta:
                yield delta

    def generate_ids(self, prompt_ids: list[int], config: GenerationConfig = GenerationConfig(),
                     on_text=None) -> GenerationResult:
        """Decode after ``prompt_ids``; ``on_text(delta)`` is called with streamed text if given."""
        detok = IncrementalDetokenizer(self.tokenizer) if on_text is not None else None
        new_ids: list[int] = []
        start = time.perf_counter()
        for chunk in self.stream_ids(prompt_ids, config):
            new_ids.extend(chunk)
            if detok is not None:
                delta = detok.push(chunk)
                if delta:
                    on_text(delta)
        seconds = time.perf_counter() - start
        finished = bool(new_ids) and new_ids[-1] in self.eos_token_ids
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return GenerationResult(text, new_ids, list(prompt_ids), seconds, "stop" if finished else "length",
                                self.decoder.stats)

    def generate(self, prompt: str, config: GenerationConfig = GenerationConfig(), on_text=None) -> GenerationResult:
        return self.generate_ids(self.encode(prompt, config.chat), config, on_text)
