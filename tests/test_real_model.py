"""The real default model (SmolLM2-135M-Instruct): every lossless method gives plain greedy's tokens.

Skipped, with the reason, when the converted model is not in the local cache (tests never download); in CI, whose
.ci/run prepares it, a missing model fails instead. Deterministic
(greedy, fp32 on CPU): no false-failure odds beyond an exact argmax tie, which a real model's logits make negligible.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from transformers import GenerationConfig as HFGenerationConfig

from jointspec.api import GenerationConfig, Pipeline
from jointspec.backends import embedded
from jointspec.backends.hf import CausalLM
from jointspec.methods import MethodConfig

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and say why they are prime.",
]
# 24 tokens: several 4-token rounds per method, and under a few seconds per generation on a CPU.
MAX_NEW_TOKENS = 24


@pytest.mark.slow
def test_lossless_methods_match_plain_greedy_on_the_default_model():
    if not embedded.is_prepared():
        if os.environ.get("CI") == "true":  # .ci/run prepares it: a skip there would hide a broken claim
            pytest.fail(f"CI: the default model is not prepared in {embedded.default_model_dir()}")
        pytest.skip(f"the default model is not prepared in {embedded.default_model_dir()} "
                    "(run `jointspec generate` once to prepare it); tests never download")
    from jointspec.backends.loading import load_model

    target, tokenizer = load_model("default")
    config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
    methods = {
        "ar": MethodConfig(name="ar"),
        "pld": MethodConfig(name="pld", num_draft_tokens=4),
        "sps-self": MethodConfig(name="sps", draft="self", num_draft_tokens=4, cost_aware=False),  # every round
        "default": MethodConfig(name="default"),  # the shipped head's top-3 trees and lookup, on the CPU kernels
    }
    pipelines = {name: Pipeline(target, tokenizer, method) for name, method in methods.items()}
    eos_token_ids = sorted(pipelines["ar"].eos_token_ids)
    drafted = {name: [0, 0] for name in methods}  # [drafted, accepted] over the prompts

    for prompt in PROMPTS:
        prompt_ids = pipelines["ar"].encode(prompt, chat=True)
        results = {name: pipeline.generate_ids(prompt_ids, config) for name, pipeline in pipelines.items()}
        reference = results["ar"]
        assert reference.text.strip(), f"empty output for {prompt!r}"
        for name, result in results.items():
            assert result.token_ids == reference.token_ids, f"{name} differs from ar on {prompt!r}"
            drafted[name][0] += result.stats.num_draft_tokens
            drafted[name][1] += result.stats.num_accepted_tokens
        # The target drafting for itself accepts every draft token, but those past an end of sequence inside its
        # last draft, which are neither committed nor counted.
        stats = results["sps-self"].stats
        uncounted = stats.num_draft_tokens - stats.num_accepted_tokens
        assert stats.num_draft_tokens > 0 and (uncounted == 0 or (
            results["sps-self"].token_ids[-1] in eos_token_ids and uncounted < 4)), stats
    # Equal tokens prove nothing about a method that never drafted: each speculative one must have drafted and kept
    # some (these prompts' answers repeat their own words, and the shipped head agrees about 40 % of the time).
    for name in ("pld", "default"):
        assert drafted[name][1] > 0, f"{name} drafted {drafted[name][0]} tokens and kept {drafted[name][1]}"

    # ar itself against transformers' own greedy decoding, on the last prompt.
    ids = torch.tensor([prompt_ids])
    hf = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=HFGenerationConfig(
        do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos_token_ids,
        pad_token_id=eos_token_ids[0]))
    assert hf[0, len(prompt_ids):].tolist() == reference.token_ids

    # The bf16 copy that CUDA runs by default finds the same shipped head (by its bf16 fingerprint).
    from jointspec.drafts.artifact import shipped_head_for

    shipped = shipped_head_for(target)
    assert shipped is not None
    assert shipped_head_for(CausalLM(copy.deepcopy(target.model).to(torch.bfloat16), name="bf16 copy")) == shipped
