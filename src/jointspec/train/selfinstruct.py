"""Training prompts written by the target itself (Magpie-style self-instruct).

A chat model fine-tuned on conversations has learnt what users ask. Feed it its chat template up to the point where a
user's message begins (``<|im_start|>user\\n`` for SmolLM2, after the default system turn) and sample: it writes a
user request. Then the target answers those requests greedily like any other training prompt
(:mod:`jointspec.train.data`). This is Magpie's recipe (Xu et al., 2024, "Alignment Data Synthesis from Scratch by
Prompting Aligned LLMs with Nothing"), used here for prompt *diversity*, not for alignment.

Why it matters: a head trained on answers to a few hundred templated instructions ("Explain {topic} to a
ten-year-old.") agreed with the target 45.7 % on held-out answers to the same templates, but 33 % on MT-Bench
answers, both teacher-forced. Its decoding acceptance on MT-Bench (32 %) matched the latter: the head had learnt the
templates' answers, not the target. Self-written requests cover what the target has seen users ask, cost nothing but
target time, need no data set and carry no licence.

Every request is drawn with its own seeded generator, so the same settings give the same prompts; duplicates, empty
texts and requests cut off by the length limit are dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jointspec.backends.hf import CausalLM

log = logging.getLogger(__name__)

_SENTINEL = "\u2063JOINTSPEC_USER_TURN\u2063"


@dataclass(frozen=True)
class SelfInstructConfig:
    num_prompts: int = 1200
    max_prompt_tokens: int = 96  # a request that is still going at this length is dropped, not cut
    min_prompt_chars: int = 12
    temperature: float = 1.0
    top_p: float = 0.95
    batch_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.max_prompt_tokens < 4 or self.batch_size < 1:
            raise ValueError(f"bad self-instruct settings: {self}")
        if not 0 < self.top_p <= 1 or self.temperature <= 0:
            raise ValueError(f"self-instruct needs sampling (temperature > 0, top_p in (0, 1]), got "
                             f"temperature {self.temperature}, top_p {self.top_p}")


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's message text begins.

    Found by rendering a conversation whose user message is a sentinel string and cutting at the sentinel, so it
    follows whatever template the tokenizer has (system turn included, if the template adds one by default).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self-instruct prompts need a chat model: this tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not show the user's message verbatim; cannot find where it begins")
    return list(tokenizer(text[:text.index(_SENTINEL)], add_special_tokens=False)["input_ids"])


def self_instruct_prompts(target: CausalLM, tokenizer, config: SelfInstructConfig = SelfInstructConfig(),
                          eos_token_ids: frozenset[int] = frozenset(), progress: bool = True) -> list[str]:
    """Up to ``config.num_prompts`` distinct user requests sampled from ``target`` (deterministic in the seed)."""
    from jointspec.batch.engine import BatchEngine, BatchRequest
    from jointspec.core.loop import DecodeConfig
    from jointspec.core.sampling import SamplingConfig

    if not eos_token_ids:
        raise ValueError("self-instruct needs the target's end-of-turn token ids to know where a request ends")
    prefix = tuple(user_turn_prefix(tokenizer))
    decode = DecodeConfig(max_new_tokens=config.max_prompt_tokens, eos_token_ids=eos_token_ids,
                          sampling=SamplingConfig(temperature=config.temperature, top_p=config.top_p))
    engine = BatchEngine(target, tokenizer, max_batch_size=config.batch_size)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=config.num_prompts, desc="self-instruct prompts", unit="prompt")
    found: list[str] = []
    seen: set[str] = set()
    seed = config.seed * 1_000_003
    # Draw in rounds until enough distinct requests survive the filters; a model that never ends a request within
    # the limit (or repeats itself) would loop forever, so the number of draws is capped.
    max_draws = 4 * config.num_prompts
    draws = 0
    while len(found) < config.num_prompts and draws < max_draws:
        count = min(config.batch_size * 4, max_draws - draws)
        requests = [BatchRequest(prefix, decode, seed=seed + draws + i) for i in range(count)]
        draws += count
        for ids in engine.generate(requests):
            if not ids or ids[-1] not in eos_token_ids:
                continue  # cut off by the length limit: an unfinished request would teach unfinished answers
            text = tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
            key = " ".join(text.lower().split())
            if len(text) < config.min_prompt_chars or key in seen:
                continue
            seen.add(key)
            found.append(text)
            if bar is not None:
                bar.update(1)
            if len(found) == config.num_prompts:
                break
    if bar is not None:
        bar.close()
    if len(found) < config.num_prompts:
        log.warning("self-instruct: %d distinct requests from %d draws (wanted %d)", len(found), draws,
                    config.num_prompts)
    return found
