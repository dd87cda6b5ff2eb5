"""Run every method on every prompt, prompt-major, and keep what each run measured.

Order: one discarded warm-up of each method (on the first prompt), then for each prompt, ``repeats`` times, every
method in turn. Interleaving methods within a prompt means that drift in machine speed (other processes, thermal
limits) hits all methods alike. When sampling, every method draws a prompt's turn with the same seed, and each
prompt and turn with its own, derived from ``BenchConfig.seed`` (:func:`prompt_seed`). Outputs come from the first
timed repeat; later repeats only add timings (and a warning if a method's output changes between repeats).
Perplexity and the comparison with the baseline are computed after timing, outside the timers.

The runner takes an already loaded target and tokenizer (tests pass tiny in-process models; the CLI loads the real
ones). Methods that run on llama.cpp (``llamacpp``, ``llamacpp-pld``, ``...:backend=llamacpp``) share one
:class:`LlamaCppBackend` over ``BenchConfig.llamacpp_model``, loaded only when such a method is listed.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from jointspec.analysis.quality import token_logprobs
from jointspec.backends.hf import CausalLM
from jointspec.backends.loading import load_model, quantized_copy, stock_copy
from jointspec.backends.tokens import eos_token_ids
from jointspec.bench.costmodel import TargetCost, measure_target_cost
from jointspec.bench.engines import LlamaCppBackend, LoadDraft, TurnOutput, build_engine, penalties_refusal
from jointspec.bench.prompts import BenchPrompt, chat_prompt_ids, check_prompts_fit
from jointspec.bench.specs import MethodSpec, MethodSpecError, method_config
from jointspec.core.loop import SpecStats
from jointspec.core.penalties import Penalties
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.approximate import with_attention
from jointspec.kernels.fp32 import GQA_ATTENTION, attention_in_use, kernels_in_use
from jointspec.methods import MethodConfig
from jointspec.methods.registry import method_reads, resolved_cost_aware

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    max_new_tokens: int = 128
    repeats: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, amount) pairs, as GenerationConfig's
    seed: int = 0
    warmup: bool = True
    perplexity: bool = True
    cost_model: bool = True
    cost_repeats: int = 7
    # The GGUF the llama.cpp methods run ('default' or a .gguf path): the same model as the torch target, so that
    # outputs compare and perplexity under the torch target means something.
    llamacpp_model: str = "default"
    # llama.cpp threads (None: torch's current intra-op thread count, which `bench --threads` sets).
    threads: int | None = None
    # The target's own quantisation, as the bench loaded it (--quantize; 'auto -> int4' where auto decided).
    quantize: str = "none"
    # What a method's quantize=auto (the `default` method's unless told otherwise) adds to this bench's target: 'int4'
    # where a float target's copy on the int4 kernels recovers the model's own weights
    # (backends.loading.resolve_quantize), else 'none' (also where the target is loaded quantised already).
    auto_quantize: str = "none"
    # What the quantised copies' caches store (--kv-cache; backends.loading.quantized_copy).
    kv_cache: str = "auto"
    # Further chat template variables for every prompt (--chat-template-kwargs: Qwen3's enable_thinking).
    chat_template_kwargs: dict | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        _ = self.sampling  # building it validates temperature, top-k, top-p and min-p
        _ = self.penalties

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.logit_bias)


@dataclass
class PromptRun:
    """One method on one prompt (all its turns)."""

    prompt_index: int
    question_id: str
    category: str
    method: str
    prompt_ids: list[list[int]]  # per turn
    output_ids: list[list[int]]  # per turn
    seconds: list[float]  # per timed repeat, all turns together
    num_target_calls: int
    stats: SpecStats | None  # all turns merged; None for transformers' generate
    # The process's peak during the runs: the weights and every other row's drafts and caches still held included.
    peak_rss_bytes: int = 0
    # The most a run raised the process's memory above what was resident when it began: this row's own use
    # (its caches once grown, the most a run allocates at once), apart from the other rows'. None where the process
    # cannot say (no /proc, or a peak that cannot be reset between runs and so holds the other rows' too).
    added_rss_bytes: int | None = 0
    cuda_peak_bytes: int | None = None
    identical: bool = False  # same tokens as the baseline on every turn
    logprob_sum: float = 0.0  # under the raw target, over every generated token
    num_scored_tokens: int = 0
    prefill_seconds: list[float] | None = None  # per timed repeat, all turns; None where an engine does not say
    output_text: list[str] = field(default_factory=list)  # per turn, decoded: what scorers such as pass@k read

    @property
    def decode_seconds(self) -> float | None:
        """The median over repeats of the time after the prompt was read (None without prefill times)."""
        if self.prefill_seconds is None:
            return None
        return statistics.median(s - p for s, p in zip(self.seconds, self.prefill_seconds))

    @property
    def num_new_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_ids)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class BenchResult:
    config: BenchConfig
    methods: list[str]  # labels, baseline first
    baseline: str
    runs: list[PromptRun]
    target_cost: TargetCost | None
    environment: dict = field(default_factory=dict)
    settings: dict[str, dict] = field(default_factory=dict)  # each row's settings as run (row_settings), by label


LLAMACPP_MAX_CONTEXT = 32768


def memoised_loader(device: str, dtype: str | None) -> LoadDraft:
    """Load each draft model once, however many methods name it."""
    loaded: dict[str, tuple[CausalLM, object]] = {}

    def load(source: str) -> tuple[CausalLM, object]:
        if source not in loaded:
            loaded[source] = load_model(source, device=device, dtype=dtype, name=source)
        return loaded[source]
    return load


def run_bench(target: CausalLM, tokenizer, prompts: list[BenchPrompt], specs: list[MethodSpec], baseline: str,
              config: BenchConfig = BenchConfig(), defaults: MethodConfig = MethodConfig(),
              load_draft: LoadDraft | None = None, progress: bool = True) -> BenchResult:
    """Run every method of ``specs`` on every prompt, prompt-major (each prompt by every method before the next, so
    drift in machine speed hits every method alike); compare outputs with ``baseline`` and score them."""
    load_at_start = _load_average()
    labels = [s.label for s in specs]
    if baseline not in labels:
        raise MethodSpecError(f"baseline '{baseline}' is not among the methods ({', '.join(labels)})")
    if not prompts:
        raise ValueError("no prompts to run")
    # llama.cpp's rows read within their own, capped context (below): the prompts must fit that too.
    check_prompts_fit(prompts, tokenizer, min(target.max_context, LLAMACPP_MAX_CONTEXT)
                      if any(s.needs_llamacpp for s in specs) else target.max_context, config.chat_template_kwargs)
    specs = sorted(specs, key=lambda s: s.label != baseline)  # baseline first
    load_draft = load_draft or memoised_loader(str(target.device), None)
    refusal = next(filter(None, (penalties_refusal(s, config.penalties) for s in specs)), None)
    if refusal:  # before anything is loaded or decoded
        raise MethodSpecError(refusal)
    config.penalties.check_vocab(target.vocab_size)  # a bias on a token the model lacks: before the run too
    eos = eos_token_ids(target, tokenizer)
    llamacpp = None
    if any(s.needs_llamacpp for s in specs):
        # llama.cpp's context as long as the target's (capped: its cache is allocated up front), so that both sides
        # decode every prompt that fits the target.
        llamacpp = LlamaCppBackend(config.llamacpp_model, tokenizer, config.threads or torch.get_num_threads(),
                                   n_ctx=min(target.max_context, LLAMACPP_MAX_CONTEXT))
    targets = _TargetCopies(target, config)
    engines = {s.label: build_engine(s, targets.for_spec(s), tokenizer, defaults, load_draft, eos, llamacpp)
               for s in specs}
    cost = measure_target_cost(target, repeats=config.cost_repeats, seed=config.seed) if config.cost_model else None

    total = len(prompts) * config.repeats * len(engines) + (len(engines) if config.warmup else 0)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress, dynamic_ncols=True) as bar:
        if config.warmup:
            for label, engine in engines.items():
                bar.set_postfix_str(f"warm-up {label}")
                run_conversation(engine, tokenizer, prompts[0], config)
                bar.update()
        runs = [run for index, prompt in enumerate(prompts)
                for run in _time_prompt(index, prompt, engines, tokenizer, config, target.device, bar)]

    _compare_and_score(runs, baseline, target, config)
    env = environment(target) | {"load_average_start": load_at_start, "load_average_end": _load_average()}
    if llamacpp is not None:
        env |= llamacpp.environment()
    return BenchResult(config, list(engines), baseline, runs, cost, env,
                       {spec.label: row_settings(spec, defaults, targets.quantize(spec), config.llamacpp_model)
                        for spec in specs})


def row_settings(spec: MethodSpec, defaults: MethodConfig, quantize: str, llamacpp_model: str = "default") -> dict:
    """What a row ran, for the report: a jointspec method's every setting it reads, as resolved from the shared
    options and the spec (``cost_aware`` as the method resolves it), and where it ran; for a reference engine
    (transformers, llama.cpp) its spec's options. A row on llama.cpp names the GGUF it ran (``llamacpp_model``),
    which is not the bench's target where that is a folder."""
    on_llamacpp = {"model": llamacpp_model} if spec.is_llamacpp_reference or spec.backend == "llamacpp" else {}
    if spec.is_hf or spec.is_llamacpp_reference:
        return {"method": spec.name, "options": dict(spec.options), **on_llamacpp}
    config = method_config(spec, defaults)
    reads = sorted(method_reads(spec.name))
    settings = {key: getattr(config, key) for key in reads if hasattr(config, key)}
    if "cost_aware" in settings:
        settings["cost_aware"] = resolved_cost_aware(config)
    if isinstance(settings.get("tree"), tuple):
        settings["tree"] = list(settings["tree"])
    for key in ("draft", "tree"):  # None: the method chooses (the head shipped for the target; its own tree)
        if key in settings and settings[key] is None:
            settings[key] = "the method's own"
    # "as loaded": the bench's target itself (the report's model line says how it was loaded), not a copy.
    placement = {"quantize": "as loaded" if quantize == "none" else quantize, "backend": spec.backend,
                 "kv": spec.kv, "attention": spec.attention, "kernels": spec.kernels, "memory": spec.memory}
    return {"method": spec.name, **settings, **placement, **on_llamacpp}


class _TargetCopies:
    """The target as each spec runs it: itself, or one copy per quantisation or kernel choice that specs name, with a
    float16 or float32 cache where the spec says ``kv=float16`` / ``kv=float32``, decoding over part of its cache where
    it says ``attention=sparse`` or ``attention=speckv``, reading part of a long prompt where it says
    ``attention=specpc``."""

    def __init__(self, target: CausalLM, config: BenchConfig) -> None:
        self.target, self.config = target, config
        self.copies: dict[str, CausalLM] = {}
        self.other_cache: dict[tuple[int, str], CausalLM] = {}  # by id() of the target (or copy) forked, and kv

    def quantize(self, spec: MethodSpec) -> str:
        if spec.backend != "torch":
            return "none"
        return self.config.auto_quantize if spec.quantize == "auto" else spec.quantize

    def for_spec(self, spec: MethodSpec) -> CausalLM:
        target = self._weights_for(spec)
        if spec.kv != "loaded":  # the same weights, its own cache in that dtype
            key = (id(target), spec.kv)
            if key not in self.other_cache:
                self.other_cache[key] = target.fork(f"{target.name}, {spec.kv} KV cache",
                                                    kv_dtype=getattr(torch, spec.kv))
            target = self.other_cache[key]
        return with_attention(target, spec.attention)  # lossy unless 'full': the target sees part of its input

    def _weights_for(self, spec: MethodSpec) -> CausalLM:
        target, mode = self.target, self.quantize(spec)
        if spec.kernels == "stock" and (kernels_in_use(target.model) == "onednn"
                                        or attention_in_use(target.model) == GQA_ATTENTION):
            key, make = "stock kernels", stock_copy
        elif mode != "none":
            key, make = mode, lambda original: quantized_copy(original, mode, self.config.kv_cache)
        else:
            return target
        if key not in self.copies:
            self.copies[key] = make(target)
        return self.copies[key]


def _time_prompt(index: int, prompt: BenchPrompt, engines: dict, tokenizer, config: BenchConfig, device,
                 bar) -> list[PromptRun]:
    """Every method on one prompt, ``config.repeats`` times; one run per method (times of every repeat)."""
    by_method: dict[str, PromptRun] = {}
    for engine in engines.values():
        if engine.warm_per_prompt:
            run_conversation(engine, tokenizer, prompt, config)
    for repeat in range(config.repeats):
        for label, engine in engines.items():
            bar.set_postfix_str(f"{prompt.category} {prompt.question_id} {label}")
            peak_reset = reset_peak_memory(device)
            resident = current_rss()
            turns = run_conversation(engine, tokenizer, prompt, config)
            rss, cuda = peak_memory(device)
            added = max(0, rss - resident) if peak_reset and resident is not None and rss else None
            seconds = sum(out.seconds for _, out in turns)
            prefill = (None if any(out.prefill_seconds is None for _, out in turns)
                       else sum(out.prefill_seconds for _, out in turns))
            if repeat == 0:
                by_method[label] = _new_run(index, prompt, label, turns, seconds, rss, cuda)
                by_method[label].added_rss_bytes = added
                by_method[label].prefill_seconds = None if prefill is None else [prefill]
                by_method[label].output_text = [tokenizer.decode(out.new_ids, skip_special_tokens=True)
                                                for _, out in turns]
            else:
                run = by_method[label]
                run.seconds.append(seconds)
                if run.prefill_seconds is not None and prefill is not None:
                    run.prefill_seconds.append(prefill)
                else:
                    run.prefill_seconds = None
                run.peak_rss_bytes = max(run.peak_rss_bytes, rss)
                run.added_rss_bytes = (None if run.added_rss_bytes is None or added is None
                                       else max(run.added_rss_bytes, added))
                if [out.new_ids for _, out in turns] != run.output_ids:
                    log.warning("%s gave a different output on repeat %d of prompt %s", label, repeat + 1,
                                prompt.question_id)
            bar.update()
    # Rows that learn online remember this prompt's answers only now: every repeat drafted without them.
    for label, engine in engines.items():
        if engine.memory is not None:
            for prompt_ids, new_ids in zip(by_method[label].prompt_ids, by_method[label].output_ids):
                engine.memory.add(prompt_ids, new_ids)
    return [by_method[label] for label in engines]


def run_conversation(engine, tokenizer, prompt: BenchPrompt,
                     config: BenchConfig) -> list[tuple[list[int], TurnOutput]]:
    """Ask each turn after the method's own previous answers, as Spec-Bench does."""
    messages: list[dict[str, str]] = []
    turns: list[tuple[list[int], TurnOutput]] = []
    for turn, text in enumerate(prompt.turns):
        messages.append({"role": "user", "content": text})
        prompt_ids = chat_prompt_ids(tokenizer, messages, config.chat_template_kwargs)
        seed = prompt_seed(config.seed, prompt.question_id, turn)
        out = engine.generate(prompt_ids, config.max_new_tokens, config.sampling, seed, penalties=config.penalties)
        turns.append((prompt_ids, out))
        messages.append({"role": "assistant", "content": tokenizer.decode(out.new_ids, skip_special_tokens=True)})
    return turns


def prompt_seed(seed: int, question_id: str, turn: int) -> int:
    """The sampling seed of one turn of one prompt: every method draws with it, each prompt with its own.

    One seed for every prompt would reuse the same random numbers on each: answers to different prompts are then
    correlated (a tiny model gave nearly the same answer to every prompt), so a bench's perplexity rests on fewer
    independent draws than it has prompts, and intervals over prompts come out too narrow. Derived from the
    question id, not the prompt's position, so a prompt draws the same whichever others are selected with it."""
    digest = hashlib.sha256(f"{seed}:{question_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a non-negative 63-bit seed for torch.Generator


def _new_run(index: int, prompt: BenchPrompt, label: str, turns: list[tuple[list[int], TurnOutput]],
             seconds: float, rss: int, cuda: int | None) -> PromptRun:
    stats = None
    if all(out.stats is not None for _, out in turns):
        stats = SpecStats()
        for _, out in turns:
            stats.merge(out.stats)
    return PromptRun(index, prompt.question_id, prompt.category, label, [ids for ids, _ in turns],
                     [out.new_ids for _, out in turns], [seconds], sum(out.num_target_calls for _, out in turns),
                     stats, rss, cuda)


def _compare_and_score(runs: list[PromptRun], baseline: str, target: CausalLM, config: BenchConfig) -> None:
    reference = {run.prompt_index: run.output_ids for run in runs if run.method == baseline}
    scored: dict[tuple, tuple[float, int]] = {}  # lossless methods repeat the baseline's tokens: score them once
    for run in runs:
        run.identical = run.output_ids == reference[run.prompt_index]
        if not config.perplexity:
            continue
        for prompt_ids, new_ids in zip(run.prompt_ids, run.output_ids):
            key = (tuple(prompt_ids), tuple(new_ids))
            if key not in scored:
                logprobs = token_logprobs(target, prompt_ids, new_ids)
                scored[key] = (float(logprobs.sum()), len(new_ids))
            total, count = scored[key]
            run.logprob_sum += total
            run.num_scored_tokens += count


def reset_peak_memory(device: torch.device) -> bool:
    """Reset the process's peak resident size (and CUDA's peak); whether the former could be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM) to the current one
    except OSError:
        return False  # not Linux or not allowed: the peak then covers the whole process so far
    return True


def current_rss() -> int | None:
    """This process's resident set size in bytes now (None where /proc does not say)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_memory(device: torch.device) -> tuple[int, int | None]:
    """(peak resident set size of this process in bytes, CUDA max allocated bytes or None)."""
    rss = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    rss = int(line.split()[1]) * 1024
    except OSError:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cuda = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return rss, cuda


def linear_kernels(model) -> str:
    """What a torch model's linear layers run on, for the report: jointspec's grouped kernels and their build,
    PyTorch's quantised kernels, oneDNN or PyTorch's own ("" for a model that is not a torch module)."""
    if model is None:
        return ""
    from jointspec.kernels.grouped import GROUPED_LINEARS, selected_isa
    from jointspec.kernels.quantize import Int4Linear, Int8Linear

    kinds = {type(module) for module in model.modules()}
    if any(issubclass(kind, GROUPED_LINEARS) for kind in kinds):
        return f"jointspec's {selected_isa()} kernels"
    if kinds & {Int4Linear, Int8Linear}:
        return "PyTorch's quantised kernels"
    return {"onednn": "oneDNN", "stock": "PyTorch's own kernels"}[kernels_in_use(model)]


def environment(target: CausalLM) -> dict:
    import transformers

    import jointspec  # its __version__ also works from a source checkout that is not installed

    device = target.device
    model = target.model if target.capabilities.torch_module else None
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = _cpu_name()
    return {"model": target.name, "device": str(device), "device_name": device_name,
            "dtype": str(target.dtype).replace("torch.", ""), "num_threads": torch.get_num_threads(),
            "kernels": linear_kernels(model), "attention": attention_in_use(model),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "jointspec": jointspec.__version__,
            "jointspec_commit": source_commit(Path(jointspec.__file__).parent)}


def source_commit(folder: Path) -> str | None:
    """The git commit of the checkout whose tracked files ``folder`` is, with "+changes" where tracked files differ
    from it; None outside such a checkout (an installed wheel) or without git."""
    import subprocess

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short=12", "HEAD")
    # Only a checkout that holds the package itself: an installed copy inside some other repository (a virtual
    # environment in a project's folder) is not that repository's code.
    if not commit or git("ls-files", "--error-unmatch", "__init__.py") is None:
        return None
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def _load_average() -> float | None:
    """The 1-minute load average: above the CPU count, other processes were competing for the cores."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _cpu_name() -> str:
    from jointspec.kernels.cpu import cpu_name

    return cpu_name() or platform.processor() or "cpu"


def perplexity_of(runs: list[PromptRun]) -> float:
    count = sum(r.num_scored_tokens for r in runs)
    return math.exp(-sum(r.logprob_sum for r in runs) / count) if count else float("nan")
