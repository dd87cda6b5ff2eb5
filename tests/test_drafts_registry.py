"""``bind_trained_draft`` binds a head per request without reading it again: a server builds each request's method on
a fork of its target, and loading, checking and converting a head took a fifth of a short answer. Every head kind
(drafts that read the target's features) is bound once per target model and folder contents; later binds share its
weights with their own feature mirror and state. Deterministic comparisons: no false failures."""

from __future__ import annotations

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.drafts.artifact import HeadConfig
from jointspec.drafts.eagle import EagleHead
from jointspec.drafts.eagle3 import Eagle3Config, Eagle3Head
from jointspec.drafts.hydra import HydraConfig, HydraHeads
from jointspec.drafts.medusa import MedusaConfig, MedusaHeads
from jointspec.drafts.registry import bind_trained_draft
from jointspec.methods.costs import draft_cost_per_call

from helpers import random_prompt, tiny_llama, untrained_draft_of

KINDS = {"eagle": (EagleHead, HeadConfig, {}), "medusa": (MedusaHeads, MedusaConfig, {}),
         "hydra": (HydraHeads, HydraConfig, {}), "eagle3": (Eagle3Head, Eagle3Config, {"aux_layers": (0, 2, 3)})}


def saved_head(kind: str, target: CausalLM, folder, seed: int):
    module_class, config_class, shape = KINDS[kind]
    head = untrained_draft_of(module_class, config_class, target, seed, draft_vocab_size=40, **shape)
    with torch.no_grad():  # weights that move the drafts, so that two seeds draft differently
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    head.save(folder)


def drafted_logits(draft, context: list[int]) -> torch.Tensor:
    draft.target.reset()
    draft.target.forward(context[:-1], num_logits=0)
    return draft.forward(context + [5, 6]).logits


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_second_bind_shares_the_weights_and_drafts_what_a_fresh_load_drafts(kind, tmp_path):
    model = tiny_llama(0, layers=4)
    target = CausalLM(model, name="tiny-target")
    folder = tmp_path / "head"
    saved_head(kind, target, folder, seed=2)
    first, second = bind_trained_draft(folder, target.fork("a")), bind_trained_draft(folder, target.fork("b"))
    shared = [name for name, value in vars(first).items() if isinstance(value, torch.nn.Module | torch.Tensor)
              and value is vars(second).get(name)]
    assert shared and type(second) is type(first)  # the modules and tensors themselves, not copies
    assert second.mirror is not first.mirror and second.target is not first.target
    assert draft_cost_per_call(first) == draft_cost_per_call(second)  # measured once (two timings would differ)
    context = random_prompt(6)
    fresh_logits = drafted_logits(bind_trained_draft(folder, CausalLM(tiny_llama(0, layers=4), name="tiny-target")),
                                  context)
    assert torch.equal(drafted_logits(first, context), fresh_logits)
    assert torch.equal(drafted_logits(second, context), fresh_logits)
    cached = second.num_cached
    first.crop(0)  # one request's draft moves; the other's state is its own
    assert first.num_cached == 0 and second.num_cached == cached > 0
    saved_head(kind, target, folder, seed=3)  # saved again into the folder: read again
    again = bind_trained_draft(folder, target.fork("d"))
    assert not torch.equal(drafted_logits(again, context), fresh_logits)
