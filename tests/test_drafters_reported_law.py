"""Model drafters report the distribution they drew each draft token from, as sampled speculative decoding needs:
the verifier keeps a token with probability min(1, p / q) and draws a rejection's replacement from max(0, p - q), so
a drafter that draws from one law and reports another changes the output's law. The verifiers are tested on rows
made by hand (test_verifiers_*.py); here the rows come from the drafters themselves: ``sps``'s chain
(drafters/model.py) and ``specinfer``'s tree (drafters/tree.py), each run end to end with a seeded generator per
answer, and the joint law of the first LAW_TOKENS tokens is compared by a chi-square test with the target's own law,
enumerated. The same test must reject a drafter that reports a flattened distribution for what it drew.

The draft is the target itself at temperature 0.3 and top-k 2 (so the processed rows differ from the raw ones, and
every prefix has two continuations): drafts are kept often, so the reported rows decide much of the output.

False-failure odds: the correct drafters fail each test with probability ALPHA = 1e-4 (two tests, 2e-4 in all). The
mutants' p-values were below 1e-20 when written.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.model import ModelDrafter
from jointspec.drafters.tree import TreeDrafter
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import chi_square_pvalue, model_joint_law, random_prompt

ALPHA = 1e-4
SAMPLING = SamplingConfig(temperature=0.3, top_k=2)
LAW_TOKENS = 3
DRAWS = 1500


def flattened(draft):
    """``draft`` with its rows reported flatter than the law its tokens were drawn from."""
    if draft.draft_probs is not None:
        draft.draft_probs = torch.softmax(draft.draft_probs.clamp_min(1e-12).log() / 4, dim=-1)
    return draft


class MisreportingChain(ModelDrafter):
    def propose(self, *args, **kwargs):
        return flattened(super().propose(*args, **kwargs))


class MisreportingTree(TreeDrafter):
    def propose(self, *args, **kwargs):
        return flattened(super().propose(*args, **kwargs))


def decoder(target_model, method: str, options: dict, mutant) -> SpeculativeDecoder:
    target = CausalLM(target_model, name="tiny-target")
    config = MethodConfig(method, draft="self", cost_aware=False, **options)
    drafter, verifier = build_method(MethodContext(config, target, None, None))
    if mutant is not None:
        drafter.__class__ = mutant  # the same drafter, its reports flattened
    return SpeculativeDecoder(target, drafter, verifier)


def law_pvalue(target_model, method: str, options: dict, mutant=None) -> float:
    prompt = random_prompt(5)
    law = model_joint_law(target_model, prompt, SAMPLING, LAW_TOKENS)
    cells = sorted(law)
    counts = dict.fromkeys(cells, 0)
    spec = decoder(target_model, method, options, mutant)
    accepted = 0
    for seed in range(DRAWS):
        out = tuple(spec.generate(prompt, DecodeConfig(max_new_tokens=LAW_TOKENS + 1, sampling=SAMPLING),
                                  torch.Generator().manual_seed(seed)))[:LAW_TOKENS]
        if out not in counts:
            return 0.0  # a sequence the target cannot produce
        counts[out] += 1
        accepted += spec.stats.num_accepted_tokens
    assert accepted > DRAWS, "drafts were rarely kept: the reported rows would decide too little"
    return chi_square_pvalue(np.array([counts[c] for c in cells]), np.array([law[c] for c in cells]))


@pytest.mark.parametrize("method, options, mutant", [
    ("sps", {"num_draft_tokens": 3}, MisreportingChain),
    ("specinfer", {"tree": (2, 1)}, MisreportingTree),
])
def test_a_model_drafts_reported_law_keeps_the_targets_and_a_misreport_is_caught(target_model, method, options,
                                                                                  mutant):
    p_correct = law_pvalue(target_model, method, options)
    p_mutant = law_pvalue(target_model, method, options, mutant)
    assert p_correct > ALPHA, p_correct
    assert p_mutant < ALPHA, p_mutant
