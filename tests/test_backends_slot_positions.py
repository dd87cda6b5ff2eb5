"""Models whose attention depends on where a key sits in the cache (backends/hf.py, ``slot_position_reason``).

ALiBi (Bloom, MPT, Falcon with ``alibi``) biases each key by its distance in cache slots, and GPT-Neo's local layers
take their window over slots. Their rows are exact only where slot and position agree, so what must hold: such a
target says it scores chains only (with the reason), tree methods and tree-drafting draft models are refused by name
(they gave wrong tokens on MPT and GPT-Neo, and crashed inside transformers on Bloom and Falcon), chain methods give
plain greedy decoding token for token past GPT-Neo's window, and the server's engine decodes each request with its
own cache (the ragged cache's holes gave a lone request other tokens than generate). Llama stays as it was. Greedy
checks are deterministic (sharpened random logits).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from jointspec.backends.hf import CausalLM, slot_position_reason
from jointspec.batch.engine import BatchRequest
from jointspec.batch.lockstep import LockstepEngine, engine_for
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import SpeculativeDecoder
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import VOCAB, greedy, random_prompt, tiny_llama

COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "bloom": lambda: transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **COMMON),
    "mpt": lambda: transformers.MptConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=256, **COMMON),
    "falcon-alibi": lambda: transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                      alibi=True, max_position_embeddings=256, **COMMON),
    "gpt-neo-local": lambda: transformers.GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4, window_size=6,
                                                       attention_types=[[["global", "local"], 1]],
                                                       max_position_embeddings=256, **COMMON),
}


def tiny(kind: str):
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def decode(model, method: str, draft: str | None = None, tree=None, max_new_tokens: int = 30) -> list[int]:
    target = CausalLM(model, name=f"{method} target")
    config = MethodConfig(name=method, draft=draft, tree=tree, cost_aware=False if draft or method == "pld" else None)
    drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
    return SpeculativeDecoder(target, drafter, verifier).generate(random_prompt(1, 16), greedy(max_new_tokens))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_slot_positioned_model_scores_chains_only_and_stays_exact_on_them(kind):
    model = tiny(kind)
    capabilities = CausalLM(model).capabilities
    assert not capabilities.trees and not capabilities.sparse_view
    assert ("ALiBi" if "gpt-neo" not in kind else "local attention") in capabilities.chains_only
    expected = decode(model, "ar")
    assert decode(model, "pld") == expected  # (prompt seed 1 repeats itself: lookup drafts)
    assert decode(model, "sps", draft="self") == expected  # chains accepted whole, past GPT-Neo's 6-token window
    with pytest.raises(UnsupportedOptionError, match="scores chains only .*(ALiBi|local attention)"):
        decode(model, "specinfer", draft="self", tree=(2, 2))
    with pytest.raises(UnsupportedOptionError, match="in its draft model.*chains only"):
        decode(model, "mtad", draft="self")  # beams are a tree in the draft


@pytest.mark.parametrize("kind", ["bloom", "mpt", "gpt-neo-local"])
def test_the_server_engine_gives_each_request_its_own_cache(kind):
    """The ragged engine's batched forward crashed inside transformers on Bloom (a 4-D mask where ALiBi wants 2-D),
    and on MPT and GPT-Neo its holes shifted the keys' slots (a lone request's tokens differed from generate's on the
    sweep's unsharpened models; these sharpened ones rarely flip a greedy token, so the engine's kind is checked)."""
    model = tiny(kind)
    engine = engine_for(CausalLM(model), None, MethodConfig(name="pld"), max_batch_size=4)
    assert isinstance(engine, LockstepEngine)
    prompts = [random_prompt(seed, 16) for seed in (1, 4, 5)]
    requests = [BatchRequest(tuple(p), greedy(24), MethodConfig(name="pld", cost_aware=False)) for p in prompts]
    answers = engine.generate(requests)
    for prompt, answer in zip(prompts, answers):
        target = CausalLM(model)
        drafter, verifier = build_method(MethodContext(MethodConfig(name="ar"), target, None, None))
        assert answer == SpeculativeDecoder(target, drafter, verifier).generate(prompt, greedy(24))


def test_llama_and_a_global_gpt_neo_are_not_slot_positioned():
    assert slot_position_reason(tiny_llama(0).config) is None
    assert CausalLM(tiny_llama(0)).capabilities.trees
    config = transformers.GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4,
                                       attention_types=[[["global"], 2]], **COMMON)
    assert slot_position_reason(config) is None
    assert slot_position_reason(transformers.FalconConfig(alibi=False, **COMMON)) is None
