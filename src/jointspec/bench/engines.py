"""What the benchmark times: one engine per method, each turning prompt ids into new ids plus counters.

``JointspecEngine`` runs a registered jointspec method through :class:`jointspec.api.Pipeline`; ``HFEngine`` runs
``hf-generate``, ``hf-assisted`` (``assistant_model=``) and ``hf-pld`` (``prompt_lookup_num_tokens``) through
transformers' own ``generate`` on the same target weights, prompts, ``max_new_tokens``, temperature and seed.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..api import GenerationConfig, Pipeline
from ..loop import SpecStats, SpeculativeDecoder
from ..methods import MethodConfig, MethodContext, build_method
from ..models.adapter import CausalLM
from ..sampling import SamplingConfig
from .specs import MethodSpec, MethodSpecError, method_config

LoadDraft = Callable[[str], tuple[CausalLM, object]]


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work so that a timer reads the work's end, not its launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class TurnOutput:
    new_ids: list[int]
    seconds: float
    num_target_calls: int
    stats: SpecStats | None  # None for transformers' own generate (it exposes no acceptance counters)


class JointspecEngine:
    def __init__(self, spec: MethodSpec, target: CausalLM, tokenizer, defaults: MethodConfig,
                 load_draft: LoadDraft) -> None:
        self.spec = spec
        self.config = method_config(spec, defaults)
        self.pipeline = Pipeline(target, tokenizer)  # plain "ar"; its decoder is replaced just below
        # Built here rather than by Pipeline so that every method shares one memoised draft loader.
        drafter, verifier = build_method(MethodContext(self.config, target, tokenizer, load_draft))
        self.pipeline.method = self.config
        self.pipeline.decoder = SpeculativeDecoder(target, drafter, verifier)
        # Drafters whose first run of a prompt costs more than later ones (the oracle) get an untimed run per prompt.
        self.warm_per_prompt = bool(getattr(drafter, "warm_per_prompt", False))

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, seed: int) -> TurnOutput:
        config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=sampling.temperature,
                                  top_k=sampling.top_k, top_p=sampling.top_p, seed=seed)
        device = self.pipeline.target.device
        synchronize(device)
        start = time.perf_counter()
        result = self.pipeline.generate_ids(prompt_ids, config)
        synchronize(device)
        seconds = time.perf_counter() - start
        # 1 + rounds: the prefill is a target call too, as it is for transformers' generate.
        calls = result.stats.num_rounds + (len(prompt_ids) > 1)
        return TurnOutput(result.token_ids, seconds, calls, result.stats)


class HFEngine:
    warm_per_prompt = False

    def __init__(self, spec: MethodSpec, target: CausalLM, tokenizer, defaults: MethodConfig,
                 load_draft: LoadDraft, eos_token_ids: frozenset[int]) -> None:
        self.spec = spec
        self.model = target.model
        self.eos_token_ids = sorted(eos_token_ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        options = spec.options
        self.extra: dict = {}
        try:
            n = int(options.get("num_draft_tokens", defaults.num_draft_tokens))
            if spec.name == "hf-pld":
                self.extra = {"prompt_lookup_num_tokens": n,
                              "max_matching_ngram_size": int(options.get("max_ngram", defaults.max_ngram))}
            elif spec.name == "hf-assisted":
                assistant = self._assistant(options.get("draft", defaults.draft), load_draft)
                # transformers reads these from the assistant's generation config, not from generate's arguments.
                assistant.generation_config.num_assistant_tokens = n
                assistant.generation_config.num_assistant_tokens_schedule = options.get("schedule", "constant")
                # 0: always draft n tokens, like jointspec's sps (transformers' default stops early).
                assistant.generation_config.assistant_confidence_threshold = float(options.get("confidence", 0.0))
                self.extra = {"assistant_model": assistant}
        except ValueError as error:
            raise MethodSpecError(f"bad option value in '{spec.label}': {error}") from error

    def _assistant(self, draft: str | None, load_draft: LoadDraft):
        if draft is None:
            raise MethodSpecError(f"'{self.spec.label}' needs a draft model: add draft=PATH (or draft=self), or "
                                  "pass --draft")
        # A shallow copy shares the weights but is a distinct module (for draft=self, its calls are then not
        # counted as target calls) with its own generation config, which the options above set.
        model = self.model if draft == "self" else load_draft(draft)[0].model
        assistant = copy.copy(model)
        assistant.generation_config = copy.deepcopy(model.generation_config)
        return assistant

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, seed: int) -> TurnOutput:
        device = self.model.device
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, prompt_len]
        # The same temperature -> top-k -> top-p order as jointspec.sampling (transformers' default warper order).
        options = ({"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
                    "top_p": sampling.top_p} if not sampling.greedy
                   else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None})
        calls = 0

        def count(module, args, kwargs):
            nonlocal calls
            calls += module is self.model

        hook = self.model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            # transformers samples from the global torch generator; seed it as jointspec seeds its own.
            torch.manual_seed(seed)
            synchronize(device)
            start = time.perf_counter()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id,
                                      **options, **self.extra)
            synchronize(device)
            seconds = time.perf_counter() - start
        finally:
            hook.remove()
        return TurnOutput(out[0, len(prompt_ids):].tolist(), seconds, calls, None)


def build_engine(spec: MethodSpec, target: CausalLM, tokenizer, defaults: MethodConfig, load_draft: LoadDraft,
                 eos_token_ids: frozenset[int]):
    if spec.is_hf:
        return HFEngine(spec, target, tokenizer, defaults, load_draft, eos_token_ids)
    return JointspecEngine(spec, target, tokenizer, defaults, load_draft)
