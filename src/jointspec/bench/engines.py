"""What the benchmark times: one engine per method, each turning prompt ids into new ids plus counters.

``JointspecEngine`` runs a registered jointspec method through :class:`jointspec.api.Pipeline`; ``HFEngine`` runs
``hf-generate``, ``hf-assisted`` (``assistant_model=``) and ``hf-pld`` (``prompt_lookup_num_tokens``) through
transformers' own ``generate`` on the same target weights, prompts, ``max_new_tokens``, temperature and seed.

llama.cpp: ``LlamaCppEngine`` runs ``llamacpp`` and ``llamacpp-pld`` through llama-cpp-python's own generation loop
(``Llama.generate``, with its ``LlamaPromptLookupDecoding`` draft for the latter), what a llama.cpp user gets; a
jointspec method with ``backend=llamacpp`` runs the jointspec loop on :class:`LlamaCppLM`. Both read the GGUF that
:class:`LlamaCppBackend` loads once per bench run, and take the same prompt ids as every other engine.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from jointspec.api import GenerationConfig, Pipeline
from jointspec.backends.hf import CausalLM
from jointspec.bench.specs import MethodSpec, MethodSpecError, llamacpp_options, method_config
from jointspec.core.errors import ModelLoadError
from jointspec.core.loop import SpecStats, SpeculativeDecoder
from jointspec.core.penalties import NO_PENALTIES, Penalties
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.memory import OutputMemory
from jointspec.kernels.fp32 import stock_kernels
from jointspec.methods import MethodConfig, MethodContext, build_method

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
    # Reading the prompt: the loop's prefill; llama.cpp's time to its first token. None where not measured.
    prefill_seconds: float | None = None


class JointspecEngine:
    def __init__(self, spec: MethodSpec, target: CausalLM, tokenizer, defaults: MethodConfig,
                 load_draft: LoadDraft) -> None:
        self.spec = spec
        self.config = method_config(spec, defaults)
        if self.config.draft == "self" and target.capabilities.fork and not target.capabilities.torch_module:
            # The registry's self-draft wraps the target's torch module; another backend's adapter has none, so
            # the draft is a second context over the same weights (its own cache), handed in as a loaded draft.
            self_draft = f"{target.name} (self-draft)"
            self.config = dataclasses.replace(self.config, draft=self_draft)
            load_draft = _with_self_draft(load_draft, self_draft, target, tokenizer)
        self.pipeline = Pipeline(target, tokenizer, MethodConfig(name="ar"))  # its decoder is replaced just below
        # memory=online: the method drafts from this row's earlier answers too, which the runner adds after each
        # prompt's timed runs (never a warm-up's, never before the prompt's own runs).
        self.memory = OutputMemory() if spec.memory == "online" else None
        # Built here rather than by Pipeline so that every method shares one memoised draft loader.
        drafter, verifier = build_method(MethodContext(self.config, target, tokenizer, load_draft, self.memory))
        self.pipeline.method = self.config
        self.pipeline.decoder = SpeculativeDecoder(target, drafter, verifier)
        # Drafters whose first run of a prompt costs more than later ones (the oracle) get an untimed run per prompt.
        self.warm_per_prompt = bool(getattr(drafter, "warm_per_prompt", False))

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, seed: int,
                 penalties: Penalties = NO_PENALTIES) -> TurnOutput:
        config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=sampling.temperature,
                                  top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p, seed=seed,
                                  repetition_penalty=penalties.repetition, presence_penalty=penalties.presence,
                                  frequency_penalty=penalties.frequency, logit_bias=penalties.bias)
        device = self.pipeline.target.device
        synchronize(device)
        start = time.perf_counter()
        result = self.pipeline.generate_ids(prompt_ids, config)
        synchronize(device)
        seconds = time.perf_counter() - start
        # 1 + rounds: the prefill is a target call too, as it is for transformers' generate.
        calls = result.stats.num_rounds + (len(prompt_ids) > 1)
        return TurnOutput(result.token_ids, seconds, calls, result.stats, result.stats.prefill_seconds)


# transformers' num_assistant_tokens_schedule values.
HF_SCHEDULES = ("constant", "heuristic", "heuristic_transient")


def hf_settings(spec: MethodSpec, defaults: MethodConfig) -> dict:
    """An ``hf-*`` spec's settings, checked before anything loads: a bad value raises :class:`MethodSpecError` by
    name, where transformers would fail at the warm-up or quietly run another setting (a max_ngram of 0 as 2, a
    schedule it does not know as constant)."""
    options = spec.options

    def count(key: str, default) -> int:
        text = options.get(key, default)
        try:
            value = int(text)
        except (TypeError, ValueError):
            value = 0
        if value < 1 or str(value) != str(text).strip():
            raise MethodSpecError(f"{key}={text} in '{spec.label}' must be a whole number >= 1")
        return value

    settings: dict = {}
    if spec.name == "hf-pld":
        settings = {"num_draft_tokens": count("num_draft_tokens", defaults.num_draft_tokens),
                    "max_ngram": count("max_ngram", defaults.max_ngram)}
    elif spec.name == "hf-assisted":
        schedule = options.get("schedule", "constant")
        if schedule not in HF_SCHEDULES:
            raise MethodSpecError(f"schedule={schedule} in '{spec.label}' must be one of: {', '.join(HF_SCHEDULES)}")
        try:
            confidence = float(options.get("confidence", 0.0))
        except ValueError:
            confidence = -1.0
        if not 0.0 <= confidence <= 1.0:
            raise MethodSpecError(f"confidence={options['confidence']} in '{spec.label}' must be a number in [0, 1]")
        draft = options.get("draft", defaults.draft)
        if draft is None:
            raise MethodSpecError(f"'{spec.label}' needs a draft model: add draft=PATH (or draft=self), or pass "
                                  "--draft")
        settings = {"num_draft_tokens": count("num_draft_tokens", defaults.num_draft_tokens), "schedule": schedule,
                    "confidence": confidence, "draft": draft}
    return settings


class HFEngine:
    warm_per_prompt = False
    memory = None

    def __init__(self, spec: MethodSpec, target: CausalLM, tokenizer, defaults: MethodConfig,
                 load_draft: LoadDraft, eos_token_ids: frozenset[int]) -> None:
        self.spec = spec
        self.model = target.model
        self.max_context = target.max_context
        self.eos_token_ids = sorted(eos_token_ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        settings = hf_settings(spec, defaults)
        self.extra: dict = {}
        if spec.name == "hf-pld":
            self.extra = {"prompt_lookup_num_tokens": settings["num_draft_tokens"],
                          "max_matching_ngram_size": settings["max_ngram"]}
        elif spec.name == "hf-assisted":
            assistant = self._assistant(settings["draft"], load_draft)
            # transformers reads these from the assistant's generation config, not from generate's arguments.
            assistant.generation_config.num_assistant_tokens = settings["num_draft_tokens"]
            assistant.generation_config.num_assistant_tokens_schedule = settings["schedule"]
            # 0: always draft n tokens, like jointspec's sps (transformers' default stops early).
            assistant.generation_config.assistant_confidence_threshold = settings["confidence"]
            self.extra = {"assistant_model": assistant}

    def _assistant(self, draft: str, load_draft: LoadDraft):
        # A shallow copy shares the weights but is a distinct module (for draft=self, its calls are then not
        # counted as target calls) with its own generation config, which the options above set.
        model = self.model if draft == "self" else load_draft(draft)[0].model
        assistant = copy.copy(model)
        assistant.generation_config = copy.deepcopy(model.generation_config)
        return assistant

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, seed: int,
                 penalties: Penalties = NO_PENALTIES) -> TurnOutput:
        # (penalties it cannot apply were refused before the run: penalties_refusal)
        # The same budget as jointspec's loop: the new tokens stop at the model's context.
        max_new_tokens = min(max_new_tokens, self.max_context - len(prompt_ids))
        if max_new_tokens <= 0:
            raise MethodSpecError(f"'{self.spec.label}': a prompt of {len(prompt_ids)} tokens leaves no room in the "
                                  f"model's context of {self.max_context} tokens; drop the longer prompts")
        device = self.model.device
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, prompt_len]
        # The same temperature -> top-k -> top-p order as jointspec.core.sampling (transformers' default warper order).
        options = ({"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
                    "top_p": sampling.top_p, "min_p": sampling.min_p or None} if not sampling.greedy
                   else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None})
        if penalties.repetition != 1.0:  # transformers' is the same penalty: over the prompt and the answer
            options["repetition_penalty"] = penalties.repetition
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
            # Stock transformers: the target's (and assistant's) linears on PyTorch's own kernels, not jointspec's
            # oneDNN ones, so these rows measure transformers as users run it.
            with stock_kernels(self.model), stock_kernels(self.extra.get("assistant_model", self.model)):
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                          eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id,
                                          **options, **self.extra)
            synchronize(device)
            seconds = time.perf_counter() - start
        finally:
            hook.remove()
        return TurnOutput(out[0, len(prompt_ids):].tolist(), seconds, calls, None)


def _with_self_draft(load_draft: LoadDraft, label: str, target, tokenizer) -> LoadDraft:
    def load(source: str):
        return (target.fork(label), tokenizer) if source == label else load_draft(source)
    return load


class LlamaCppBackend:
    """The llama.cpp side of one bench run: the GGUF, loaded once, and shared by every engine that needs it.

    ``source`` is 'default' (the embedded SmolLM2 GGUF, the same weights the torch target dequantises) or a .gguf
    path. Its tokenizer must be the bench's: every engine gets the same prompt ids.
    """

    def __init__(self, source: str, tokenizer, threads: int, n_ctx: int = 4096) -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.threads = threads
        self.n_ctx = n_ctx
        self._adapter = None
        self._llamas: dict[tuple[bool, bool], object] = {}

    def adapter(self):
        """The jointspec adapter (:class:`LlamaCppLM`) every ``backend=llamacpp`` method shares."""
        if self._adapter is None:
            from jointspec.backends.llamacpp import load_llamacpp

            adapter, tokenizer = load_llamacpp(self.source, n_threads=self.threads, n_ctx=self.n_ctx)
            if tokenizer.get_vocab() != self.tokenizer.get_vocab():
                raise ModelLoadError(f"the llama.cpp model '{self.source}' does not use the bench target's "
                                     "tokenizer; pass the GGUF of the same model (llama.cpp model source)")
            self._adapter = adapter
        return self._adapter

    def llama(self, logits_all: bool, flash_attn: bool = False):
        """llama-cpp-python's ``Llama`` over the same file, context and threads: with logits for every position (as
        its speculative path requires) or not; flash attention off by default, as that class has it."""
        key = (logits_all, flash_attn)
        if key not in self._llamas:
            adapter = self.adapter()  # loads and checks the file first
            from llama_cpp import Llama

            from jointspec.backends.llamacpp import llama_class_params

            with llama_class_params():
                self._llamas[key] = Llama(
                    model_path=str(adapter.model.path), n_ctx=adapter.max_context, n_batch=adapter.n_batch,
                    n_ubatch=adapter.n_batch, n_threads=self.threads, n_threads_batch=self.threads,
                    logits_all=logits_all, flash_attn=flash_attn, verbose=False)
        return self._llamas[key]

    def environment(self) -> dict:
        from importlib import metadata

        adapter = self.adapter()
        return {"llamacpp_model": str(adapter.model.path), "llamacpp_threads": self.threads,
                "llamacpp_n_ctx": adapter.max_context, "llamacpp_adapter_flash_attn": adapter.flash_attn,
                "llamacpp_extra_buffer_types": adapter.model.extra_buffer_types,
                "llama_cpp_python": metadata.version("llama-cpp-python")}


class LlamaCppEngine:
    """``llamacpp`` / ``llamacpp-pld``: llama-cpp-python's own ``Llama.generate`` loop from the prompt ids.

    Stops as the jointspec loop does: after the first EOS token (which is kept), after ``max_new_tokens`` tokens, or
    when the sequence fills the context. The KV cache is cleared first, so every run prefills the whole prompt
    (``Llama.generate`` would otherwise reuse a prefix cached by the previous run). Greedy only: llama.cpp's
    samplers apply top-k/top-p/temperature in another order and draw from their own generator.

    Flash attention is off unless the spec says ``flash_attn=true``: llama-cpp-python's default. Without it,
    llama.cpp's batched and single-token logits differ at some positions (see :mod:`jointspec.backends.llamacpp`),
    so ``llamacpp-pld`` can drift from ``llamacpp`` at near-ties, as jointspec methods on the adapter (flash
    attention on) do not.
    """

    warm_per_prompt = False
    memory = None

    def __init__(self, spec: MethodSpec, backend: LlamaCppBackend, eos_token_ids: frozenset[int]) -> None:
        self.spec = spec
        self.eos_token_ids = eos_token_ids
        options = llamacpp_options(spec)
        flash_attn = bool(options.pop("flash_attn", False))
        is_pld = spec.name == "llamacpp-pld"
        # Loads first: without llama-cpp-python this raises ModelLoadError with the install command.
        self.llama = backend.llama(logits_all=is_pld, flash_attn=flash_attn)
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.draft_model = LlamaPromptLookupDecoding(**options) if is_pld else None

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, seed: int,
                 penalties: Penalties = NO_PENALTIES) -> TurnOutput:
        # (penalties it cannot apply were refused before the run: penalties_refusal)
        if not sampling.greedy:
            raise MethodSpecError(f"'{self.spec.label}' runs greedy only (temperature 0); drop it from a sampling "
                                  "bench")
        llama = self.llama
        llama.draft_model = self.draft_model  # llamacpp-pld specs with other settings share one Llama
        budget = min(len(prompt_ids) + max_new_tokens, llama.n_ctx()) - len(prompt_ids)
        if budget <= 0:
            raise MethodSpecError(f"'{self.spec.label}': a prompt of {len(prompt_ids)} tokens leaves no room in "
                                  f"llama.cpp's context of {llama.n_ctx()} tokens; drop the longer prompts")
        calls = 0
        evaluate = type(llama).eval

        def counted_eval(tokens):
            nonlocal calls
            calls += 1
            return evaluate(llama, tokens)

        llama.eval = counted_eval  # Llama.generate calls self.eval once per target pass
        new_ids: list[int] = []
        first = None
        try:
            llama.reset()
            start = time.perf_counter()
            for token in llama.generate(prompt_ids, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                        reset=True):
                first = time.perf_counter() - start if first is None else first
                new_ids.append(int(token))
                if token in self.eos_token_ids or len(new_ids) >= budget:
                    break
            seconds = time.perf_counter() - start
        finally:
            del llama.eval
        return TurnOutput(new_ids, seconds, calls, None, first)


def penalties_refusal(spec: MethodSpec, penalties: Penalties) -> str | None:
    """Why row ``spec`` cannot decode with ``penalties`` (None: it can): transformers' generate has the repetition
    penalty alone, and llama.cpp's own loop a repeat penalty over its last tokens only."""
    if spec.is_hf and (penalties.presence or penalties.frequency):
        return (f"'{spec.label}': transformers' generate has no presence or frequency penalty (only "
                "--repetition-penalty); drop it from a run with those")
    if spec.is_hf and penalties.bias:
        return f"'{spec.label}': this bench does not pass --logit-bias to transformers' generate; drop it from the run"
    if spec.is_llamacpp_reference and penalties.bias:
        return f"'{spec.label}': this bench runs llama.cpp's loop without a logit bias; drop it from a biased run"
    if spec.is_llamacpp_reference and penalties.active:
        return (f"'{spec.label}': llama.cpp's loop applies its repeat penalty over its last tokens, not the whole "
                "text as jointspec's penalties do; drop it from a penalised run")
    return None


def build_engine(spec: MethodSpec, target: CausalLM, tokenizer, defaults: MethodConfig, load_draft: LoadDraft,
                 eos_token_ids: frozenset[int], llamacpp: LlamaCppBackend | None = None):
    if spec.needs_llamacpp and llamacpp is None:
        raise MethodSpecError(f"'{spec.label}' needs the llama.cpp backend, which this bench run was not given")
    if spec.is_hf:
        return HFEngine(spec, target, tokenizer, defaults, load_draft, eos_token_ids)
    if spec.is_llamacpp_reference:
        return LlamaCppEngine(spec, llamacpp, eos_token_ids)
    if spec.backend == "llamacpp":
        return JointspecEngine(spec, llamacpp.adapter(), tokenizer, defaults, load_draft)
    return JointspecEngine(spec, target, tokenizer, defaults, load_draft)
