"""Builders and references shared by the test modules; no test module imports another.

Fixtures live in ``conftest.py``; plain functions and constants live here, grouped by what they make:

- tiny models: :func:`tiny_llama` (conftest's recipe), :func:`quant_llama` (sizes the int4 kernel takes),
  :func:`grouped_llama` (sizes every grouped kernel and the compiled layers take), :func:`tiny_qwen2` (q/k/v biases),
  :func:`tiny_qwen3` (q/k norms), :func:`tiny_gemma3`;
- prompts and references: :func:`random_prompt`, :func:`hf_greedy` (transformers' own greedy decoding, the reference
  every method must match), :func:`first_occurrences`, :func:`greedy` (a greedy ``DecodeConfig``);
- decoders built the way the library builds them: :func:`make_decoder` (by method name), :func:`decoder_for` (with a
  draft folder), :func:`greedy_by_methods`, :func:`corpus_folder`;
- tokenizers: :func:`tiny_tokenizer` (English words and a chat template), :func:`word_tokenizer` (``w4 w5 ...``, saved
  next to a model folder), :class:`FakeTokenizer` (a vocabulary and nothing else);
- the command line: :func:`save_model`, :func:`run_cli`, :func:`assert_clean_error`, :func:`train_cli_argv`;
- trained drafts: :func:`untrained_draft_of`, :func:`untrained_head`, :func:`tiny_training_data`,
  :func:`sps_acceptance`, :func:`assert_greedy_equivalent`, :func:`assert_loads_to_the_same_decoding`;
- the bench: :data:`WORDS`, :func:`run_tiny`; the batched engine: :data:`BATCH_PROMPTS` and its settings;
- the server: :func:`byte_tokenizer` (every byte a token, with a chat template), :func:`live_server` (uvicorn on a free
  local port, in a thread).

``JOINTSPEC_TEST_DEVICE`` (default ``cpu``) puts :func:`tiny_llama`'s models, the ones the loop, method, verifier and
batch tests decode with, on another device: ``JOINTSPEC_TEST_DEVICE=cuda pytest`` runs those tests on a GPU. The int4
and compiled-layer models (:func:`quant_llama`, :func:`grouped_llama`) are CPU kernels' inputs and stay on the CPU.

Odd sizes (vocab 99, hidden 32, intermediate 37) catch shape mix-ups that round numbers hide. Every tiny model
multiplies its LM head by 8 so that greedy ties and near-ties are vanishingly rare: exact comparisons can be trusted.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import random
import shutil
import tempfile

import numpy as np
import torch
from scipy import stats
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from jointspec.backends.hf import CausalLM, forward_many
from jointspec.core.grammar import OutputFormat
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.core.target import ForwardCall
from jointspec.methods import MethodConfig, MethodContext, build_method

VOCAB = 99
TEST_DEVICE = torch.device(os.environ.get("JOINTSPEC_TEST_DEVICE", "cpu"))


def read_prompts_row_by_row(monkeypatch) -> None:
    """Compiled int4 models read prompts a row at a time on every build (the AVX-512 builds' way), so that any shared
    prefix is reusable by a prompt cache; tests/test_batch_lockstep.py holds the whole-chunk rule of the other way."""
    import math

    from jointspec.backends.lean_forward import LeanLlamaForward

    own = LeanLlamaForward._set_prefill

    def rows_alone(self):
        own(self)
        if self.compiled is not None:
            self.prefill_chunk, self.prefill_gemm_rows = 16, math.inf
    monkeypatch.setattr(LeanLlamaForward, "_set_prefill", rows_alone)


# -- tiny models ------------------------------------------------------------------------------------------------------

def tiny_llama(seed: int, *, vocab: int = VOCAB, layers: int = 2, max_positions: int = 256,
               attn: str = "sdpa", device: str | None = None) -> LlamaForCausalLM:
    """conftest's recipe, on ``device`` (default :data:`TEST_DEVICE`; ``"cpu"`` for the CPU kernels' tests)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=37, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                         attn_implementation=attn)
    model = LlamaForCausalLM(config).eval()
    # Random init gives nearly flat logits; sharpen them so greedy ties and near-ties are vanishingly rare.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.to(TEST_DEVICE if device is None else device)


def quant_llama(seed: int, *, tied: bool = False) -> LlamaForCausalLM:
    """conftest's recipe at sizes the int4 kernel accepts (out_features multiples of 16, in_features multiples of the
    group size 32): hidden 64, intermediate 96, 4 heads (head size 16), 2 KV heads, vocab 99. ``tied``: the head is
    the input embedding, as in SmolLM2."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=tied, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    # Only the tests say what ends a sequence: transformers' generate would otherwise stop at id 2, which some
    # continuations produce, while jointspec's loop is given no EOS unless a test declares one.
    model.generation_config.eos_token_id = None
    if not tied:  # a random tied model just repeats its input token (the residual stream carries its embedding)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # sharpen the logits, as conftest does
    return model


def grouped_llama(seed: int) -> LlamaForCausalLM:
    """Every layer's in_features a multiple of 64, so every linear can take the grouped kernel."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharpen the logits, as conftest does
    return model


def q8_reference(x: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """What a 4-, 5-, 6- or 8-bit grouped layer computes from float32 ``x`` [rows, in] (csrc/products.cpp,
    multiply_q8), in float64, and the magnitude of its terms (for a tolerance): each group of 32 inputs rounded to
    ``q = round(x * 127 / max|x|)`` (ties to even, float32 as the kernel rounds), then per group (or per 16 inputs,
    where the weights' scales are) ``scale * step * sum(level * q)``, plus ``minimum * step * sum(q)`` for 4 and 5
    bits: the dequantised weights times the rounded inputs."""
    rows, width = x.shape
    groups = width // 32
    if layer.bits in (6, 8):  # signed levels, 6 bits in their own storage
        levels = (layer.signed_levels() if layer.bits == 6 else layer.levels).long().reshape(-1, groups, 32)
    else:
        packed = layer.packed.reshape(-1, groups, 16)
        levels = torch.cat([packed & 15, packed >> 4], dim=-1).long()  # byte i: level i low, level i + 16 high
        fifth = getattr(layer, "fifth", None)
        if fifth is not None:
            levels = levels + 16 * ((fifth.long()[..., None] >> torch.arange(32)) & 1)
    xg = x.reshape(rows, groups, 32)
    top = xg.abs().amax(-1)
    step = top / 127.0
    inverse = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    q = torch.round(xg * inverse[..., None]).double()
    halves = lambda t: t.reshape(*t.shape[:-2], groups * 2, 16)  # noqa: E731 (16 inputs a scale at most)
    dots = torch.einsum("ogi,rgi->rog", halves(levels.double()), halves(q))  # [rows, out, 2 groups]
    magnitudes = torch.einsum("ogi,rgi->rog", halves(levels.double()).abs(), halves(q).abs())
    # The layer's float scales, whatever form it keeps them in (float32, halves, K-quant sub-scales).
    scale = (layer.unit_scales() if layer.bits in (6, 8) else layer.group_scales()[0]).double()
    scale = scale.repeat_interleave(2, dim=1) if scale.shape[1] == groups else scale  # per 16 inputs
    scaled = scale[None] * step.double().repeat_interleave(2, dim=1)[:, None, :]
    out, magnitude = (scaled * dots).sum(-1), (scaled.abs() * magnitudes).sum(-1)
    if layer.bits in (4, 5):
        lows = layer.group_scales()[1].double()[None] * (step.double() * q.sum(-1))[:, None, :]
        out, magnitude = out + lows.sum(-1), magnitude + lows.abs().sum(-1)
    return out, magnitude


def tiny_qwen2(seed: int, hidden: int = 64, intermediate: int = 128, **config):
    """A Qwen2 model (biases on q/k/v, which Llama has not) with every linear's width a multiple of 64."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, tie_word_embeddings=False,
                                         attn_implementation="sdpa", **config)).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for layer in model.model.layers:  # biases large enough to matter (they start at zero)
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_(0, 0.5)
        model.lm_head.weight.mul_(8.0)
    return model


def tiny_qwen3(seed: int, **config):
    """A Qwen3 model (per-head q/k norms before the rotary embedding, no biases) with every linear's width a multiple
    of 64 and a head size other than hidden / heads, as Qwen3's own (128 on 1,024-wide models)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         max_position_embeddings=256, tie_word_embeddings=True,
                                         attn_implementation="sdpa", **config)).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for layer in model.model.layers:  # norms that matter (they start at one)
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.25, 2.0)
        model.lm_head.weight.mul_(8.0)
    return model


def tiny_gemma3(seed: int, window: int = 4):
    """A Gemma-3 model with every linear's width a multiple of 64, in Gemma-3's layout: sliding-window layers
    (``window``), then a full-attention one (its own rotary base), q/k norms, four norms a layer, tied embeddings
    scaled by sqrt(hidden)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                              sliding_window=window, attn_implementation="sdpa",
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    model = Gemma3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def tiny_gpt_oss(seed: int, window: int = 4, vocab: int = VOCAB, max_positions: int = 256):
    """A gpt-oss model in its layout: a sliding-window layer (``window``) then a full-attention one, each head's
    learned attention sink (drawn at random here: they start at zero), 4 experts of which 2 run a token, YaRN-free
    rotary tables."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    config = GptOssConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=window, max_position_embeddings=max_positions,
                          layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    model.generation_config.eos_token_id = None
    return model


def tiny_gemma3n(seed: int, window: int = 4):
    """A Gemma 3n model: sliding and full layers whose last two read the keys and values of earlier ones (their
    cache layers hold none), AltUp, Laurel and per-layer inputs."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    torch.manual_seed(seed)
    config = Gemma3nTextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0,
                               laurel_rank=8, altup_num_inputs=2, hidden_size_per_layer_input=8,
                               vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, sliding_window=window,
                               layer_types=["sliding_attention", "full_attention"] * 2,
                               activation_sparsity_pattern=[0.0] * 4, intermediate_size=[128] * 4)
    model = Gemma3nForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def tiny_llama4(seed: int, chunk: int = 4):
    """A Llama 4 text model: a chunked-attention layer (a key seen from its own chunk of ``chunk`` positions only)
    without rotary then a full one, mixture-of-experts feed-forwards."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(seed)
    config = Llama4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                              pad_token_id=0, num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=128,
                              attention_chunk_size=chunk, no_rope_layers=[1, 0])
    model = Llama4ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def tiny_lfm2(seed: int, max_positions: int = 256):
    """A LiquidAI LFM2 model: short-convolution layers between attention ones (a hybrid whose convolutions keep their
    last few inputs: no recurrent state)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(seed)
    config = Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                        layer_types=["conv", "full_attention", "conv", "full_attention"])
    model = Lfm2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def lasting_state(model):
    """Make a tiny hybrid's recurrent states matter: at transformers' initialisation a state-space layer's state is
    about 1e-4 (its RMS norm's epsilon then drowns it), and every layer's decays within a few tokens, so replacing the
    states by zeros moved the next logits by 1e-7 to 1e-3 and a test of taking tokens back out of them could not
    fail. Slow decay (A = 0.02), no skip connection past the state (D = 0) and a Mamba input projection 30x larger
    make them move the logits by 0.08-0.8."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "A_log", None), torch.nn.Parameter):
                module.A_log.fill_(math.log(0.02))
                if isinstance(getattr(module, "D", None), torch.nn.Parameter):  # (a Mamba-2 mixer)
                    module.D.zero_()
                    module.in_proj.weight.mul_(30.0)
    return model


def tiny_granite4(seed: int):
    """An IBM Granite 4 hybrid: a Mamba-2 layer (a recurrent state-space state besides its convolution), then an
    attention one."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                                    mamba_n_groups=1, mamba_d_state=16, mamba_expand=1, shared_intermediate_size=128,
                                    num_local_experts=0)
    model = lasting_state(GraniteMoeHybridForCausalLM(config).eval())
    model.generation_config.eos_token_id = None
    return model


def tiny_falcon_h1(seed: int):
    """A TII Falcon-H1 model: each layer a Mamba-2 mixer beside attention, their states in one cache layer."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(seed)
    config = FalconH1Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                            mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)
    model = lasting_state(FalconH1ForCausalLM(config).eval())
    model.generation_config.eos_token_id = None
    return model



def tiny_qwen3_5(seed: int):
    """A Qwen3.5 text model: Gated DeltaNet linear-attention layers (a recurrent state and a short convolution each)
    between full-attention ones."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                               layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    model = lasting_state(Qwen3_5ForCausalLM(config).eval())
    model.generation_config.eos_token_id = None
    return model


def tiny_qwen3_next(seed: int):
    """A Qwen3-Next model: Qwen3.5's layer pattern with mixture-of-experts MLPs."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                             layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, decoder_sparse_step=1)
    model = lasting_state(Qwen3NextForCausalLM(config).eval())
    model.generation_config.eos_token_id = None
    return model

# -- prompts and references -------------------------------------------------------------------------------------------

def random_prompt(seed: int, length: int = 12) -> list[int]:
    """Random ids above the special ones (0 pad, 1 bos, 2 eos).

    The tiny models' greedy continuations fall into short loops sooner or later, and a loop can hide an off-by-one
    in positions. Seeds 0, 3, 5 and 6 give continuations of the target with 13 to 27 distinct tokens among the first
    40 (seed 1 loops at once: it serves the prompt-lookup test, which wants repetition)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Plain greedy decoding by transformers itself: the reference every method must match."""
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                              pad_token_id=0)
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def run_engine(engine, ids: list[int]) -> tuple[dict[int, list[int]], dict[int, Exception]]:
    """Step a batched engine until it has no work: each request's tokens, and the errors that ended requests."""
    tokens, errors = {seq_id: [] for seq_id in ids}, {}
    while engine.has_work:
        for event in engine.step():
            tokens[event.seq_id].extend(event.token_ids)
            if event.error is not None:
                errors[event.seq_id] = event.error
    return tokens, errors


def first_occurrences(tokens: list[int]) -> dict[int, int]:
    """Position of the first occurrence of each token."""
    first: dict[int, int] = {}
    for i, token in enumerate(tokens):
        first.setdefault(token, i)
    return first


def greedy(max_new_tokens: int, eos_token_ids: frozenset[int] = frozenset()) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature=0.0),
                        eos_token_ids=eos_token_ids)


# -- decoders built as the library builds them ------------------------------------------------------------------------

_corpus_folders: dict[int, str] = {}


def corpus_folder(target_model) -> str:
    """An n-gram table (``corpus``) of the target's own greedy continuations of other prompts, as `build-corpus`
    makes for a real target: random models repeat themselves, so its drafts are often accepted, and often not."""
    from jointspec.drafters.corpus import NgramTable

    if id(target_model) not in _corpus_folders:
        sequences = [hf_greedy(target_model, random_prompt(seed), 24) for seed in range(20, 30)]
        folder = tempfile.mkdtemp(prefix="jointspec-corpus-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # module-level cache: no tmp_path outlives it
        NgramTable.build(sequences, VOCAB, max_order=3, min_count=1).save(folder, {"kind": "corpus"})
        _corpus_folders[id(target_model)] = folder
    return _corpus_folders[id(target_model)]


def make_decoder(method: str, target_model, other_model=None, num_draft_tokens: int = 4):
    """A registered method built the way the library builds it, at its fixed draft length (the cost-aware wrapper,
    sps's default, has equivalence tests of its own in test_drafters_costaware.py). ``method`` is a name, or
    ``sps-other`` (``pearl-other``) for speculative sampling (PEARL) with a different random model as the draft,
    ``hybrid-self`` prompt lookup with the target as the model draft behind it."""
    target = CausalLM(target_model, name="tiny-target")
    if method == "corpus":
        name, draft = "corpus", corpus_folder(target_model)
    else:
        name, draft = {"ar": ("ar", None), "pld": ("pld", None), "sps-self": ("sps", "self"),
                       "sps-other": ("sps", "other"), "lookahead": ("lookahead", None),
                       "pearl-self": ("pearl", "self"), "pearl-other": ("pearl", "other"),
                       "hybrid-self": ("hybrid", "self"), "lade": ("lade", None), "oracle": ("oracle", None),
                       "aded": ("aded", None)}[method]

    def load_draft(source: str):
        assert source == "other"
        return CausalLM(other_model, name="tiny-other"), None

    config = MethodConfig(name=name, draft=draft, num_draft_tokens=num_draft_tokens, cost_aware=False)
    drafter, verifier = build_method(MethodContext(config, target, None, load_draft))
    return SpeculativeDecoder(target, drafter, verifier)


def decoder_for(target_model, method: str, draft_dir, **config) -> SpeculativeDecoder:
    """``method`` with the draft in ``draft_dir`` (a trained draft's folder, ``"self"``, or None for none), built as
    the library builds it (cost-aware where that is the method's default)."""
    target = CausalLM(target_model, name="tiny-target")
    method_config = MethodConfig(name=method, draft=None if draft_dir is None else str(draft_dir), **config)
    drafter, verifier = build_method(MethodContext(method_config, target, None, lambda source: None))
    return SpeculativeDecoder(target, drafter, verifier)


def assert_head_keeps_a_window(target, draft, prompt: list[int], window: int = 8) -> None:
    """``draft`` (a head bound to ``target``, its ``window`` set so), fed ``prompt`` after the target read it, holds
    the 4 sinks and the window's entries alone (drafts/eagle.py, "Long contexts")."""
    target.reset()
    target.forward(prompt, num_logits=0)
    draft.forward(prompt, num_logits=1)
    assert draft.skipped == len(prompt) - window - 4 and draft.cache.get_seq_length() == window + 4


def steady_tree_costs(monkeypatch) -> None:
    """``hybrid-tree`` (and ``default``'s tree) built with a fixed cost curve on which a tree always pays, in place of
    this machine's timings: on a loaded machine the measured curve can gate every tree round off, and an equivalence
    test must see drafts kept."""
    from jointspec.drafters.costaware import CostCurve
    from jointspec.methods import lossless

    curve = CostCurve({1: 1.0, 2: 1.01, 3: 1.02, 5: 1.04, 9: 1.08, 17: 1.16})
    monkeypatch.setattr(lossless, "target_cost_curve", lambda target: curve)
    monkeypatch.setattr(lossless, "draft_cost_per_call", lambda draft, rows=1, *, target=None: 0.01)


def fixed_length_decoder(target_model, method: str, draft_dir, **config) -> SpeculativeDecoder:
    """:func:`decoder_for`, but a method that is cost-aware by default drafts at its given length unless
    ``cost_aware`` is given: the wrapper's choice follows this machine's timings (on a tiny target a draft call costs
    about a step, and it then drafts next to nothing), and an equivalence test must see drafts kept."""
    from jointspec.methods.registry import cost_aware_by_default

    if method in cost_aware_by_default():
        config.setdefault("cost_aware", False)
    return decoder_for(target_model, method, draft_dir, **config)


def attention_masks(rows: int, keys: int, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(visible, lengths) as the compiled attention takes them, for ``rows`` new rows after ``keys - rows`` cached
    keys: causal rows, tree-style rows (the cache plus some of the draft keys) and rows that share nothing."""
    cached = keys - rows
    tree = torch.zeros(rows, keys, dtype=torch.bool)
    tree[:, :cached] = True
    tree[:, cached:] = torch.rand(rows, rows, generator=generator).tril() > 0.4
    tree[torch.arange(rows), cached + torch.arange(rows)] = True
    scattered = torch.rand(rows, keys, generator=generator) > 0.5
    scattered[:, 0] = True
    no_bool, no_long = torch.empty(0, dtype=torch.bool), torch.empty(0, dtype=torch.long)
    return [(no_bool, torch.arange(cached + 1, keys + 1)), (tree, no_long), (scattered, no_long)]


def greedy_by_methods(model, prompt: list[int], max_new_tokens: int,
                      methods=(("ar", None, None), ("sps", "self", None), ("specinfer", "self", (2, 2)))):
    """Greedy output of ``model`` on ``prompt`` under each (method, draft, tree): a chain and a tree method next to
    plain decoding, each on a fresh adapter."""
    return [decode_greedy(CausalLM(model, name=f"{name} target"), prompt, name, max_new_tokens, draft, tree)
            for name, draft, tree in methods]


def decode_greedy(target, prompt: list[int], method: str = "ar", max_new_tokens: int = 30, draft: str | None = None,
                  tree: tuple[int, ...] | None = None, accepted: list[int] | None = None) -> list[int]:
    """Greedy output of ``method`` on ``target`` (any adapter, an approximate one included); appends the accepted
    draft tokens to ``accepted`` where given. A self-draft drafts every round (not cost-aware): it costs a target step
    a token, so on the cost curve it never pays, and the equivalence would be tested on no drafts at all."""
    config = MethodConfig(name=method, draft=draft, tree=tree, cost_aware=False if draft == "self" else None)
    drafter, verifier = build_method(MethodContext(config, target, None, None))
    decoder = SpeculativeDecoder(target, drafter, verifier)
    out = decoder.generate(prompt, greedy(max_new_tokens))
    if accepted is not None:
        accepted.append(decoder.stats.num_accepted_tokens)
    return out


def assert_forward_many_is_each_alone(target: CausalLM, contexts: list[list[int]], calls, rounds: int = 2) -> None:
    """The batched pass (:func:`~jointspec.backends.hf.forward_many`) over forks of ``target`` holding ``contexts``
    gives each call exactly what its own forward gives (logits, hidden states, cache length), round after round (a
    later round runs on caches the earlier ones grew)."""
    together = [target.fork(f"together {i}") for i in range(len(calls))]
    apart = [target.fork(f"apart {i}") for i in range(len(calls))]
    for context, a, b in zip(contexts, together, apart):
        a.forward(context, num_logits=0)
        b.forward(context, num_logits=0)
    for _ in range(rounds):
        outputs = forward_many(together, calls)
        for other, call, output in zip(apart, calls, outputs):
            own = call.run(other)
            assert torch.equal(output.logits, own.logits)
            assert (output.hidden is None) == (own.hidden is None)
            if own.hidden is not None:
                assert torch.equal(output.hidden, own.hidden)
        assert [t.num_cached for t in together] == [t.num_cached for t in apart]


def assert_rows_computed_alone(target: CausalLM, context: list[int]) -> None:
    """After ``context``, a chain and every node of a tree get bit for bit the logits of feeding their tokens one
    by one (what makes plain and speculative decoding of a model agree exactly)."""
    target.forward(context, num_logits=0)
    new = [7, 8, 9, 10, 11, 12]
    chain = target.forward(new).logits
    target.crop(len(context))
    assert torch.equal(chain, torch.cat([target.forward([token]).logits for token in new]))
    target.crop(len(context))
    tree = target.forward(new[:4], parents=[-1, 0, 0, 1]).logits  # 7 -> (8 -> 10, 9)
    target.crop(len(context))
    assert torch.equal(tree[[0, 1, 3]], target.forward([7, 8, 10]).logits)
    target.crop(len(context))
    assert torch.equal(tree[[0, 2]], target.forward([7, 9]).logits)


def assert_forward_many_runs_one_pass(monkeypatch, kind: type, target: CausalLM) -> None:
    """:func:`assert_forward_many_is_each_alone` on three sequences (a step, a chain read for its argmax, a tree
    with hidden states) after contexts of 2, 9 and 16 tokens, and every round ran as one pass of ``kind``'s
    ``forward_many`` (a lean forward class), not call by call."""
    passes = []
    original = kind.forward_many
    monkeypatch.setattr(kind, "forward_many", lambda self, calls: passes.append(original(self, calls)) or passes[-1])
    contexts = [random_prompt(seed, length=length) for seed, length in enumerate((2, 9, 16))]
    calls = [ForwardCall([5]), ForwardCall([6, 7, 8], argmax_only=True),
             ForwardCall([9, 10, 11, 12], parents=[-1, 0, 0, 1], output_hidden=True)]
    assert_forward_many_is_each_alone(target, contexts, calls)
    assert len(passes) == 2 and all(result is not None for result in passes)


def assert_self_drafts_give_plain_greedy(model, method: str, tree: tuple[int, ...] | None, prompt: list[int]) -> None:
    """``method`` drafting with ``model`` itself gives plain greedy decoding's 40 tokens with drafts accepted, and
    the same when the length limit or an end of sequence falls inside a draft."""
    expected = decode_greedy(CausalLM(model, name="plain"), prompt, "ar", 40)
    target = CausalLM(model, name=f"{method} target")
    config = MethodConfig(name=method, draft="self", tree=tree, cost_aware=False)  # as decode_greedy's self-drafts
    drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
    decoder = SpeculativeDecoder(target, drafter, verifier)
    assert decoder.generate(prompt, greedy(40)) == expected
    assert decoder.stats.num_accepted_tokens > 0  # the drafts were verified, not skipped
    assert decoder.generate(prompt, greedy(7)) == expected[:7]  # max length inside a draft
    eos = expected[9]  # a token that appears mid-continuation, taken as the end of sequence
    assert decoder.generate(prompt, greedy(40, frozenset({eos}))) == expected[:expected.index(eos) + 1]


# -- tokenizers -------------------------------------------------------------------------------------------------------

WORDS = ("the a of to and in is it that for on with as was be by this are or from at an not but have "
         "summarise rewrite text code function bees hive water wings warm cold nest list every number "
         "answer question user assistant please short two sentences python def return value one more "
         "now turn make add write explain what how why when where which who count word line file name "
         "data test type hint error raise keep show whole class stack item price total").split()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over :data:`WORDS` (plus fillers up to the tiny models' 99 ids) with a minimal chat
    template: ``user : {content} assistant : ``."""
    specials = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]
    extra = [":", "(", ")", ".", ","]
    vocab = {tok: i for i, tok in enumerate(specials + extra + list(WORDS))}
    assert len(vocab) <= VOCAB
    for i in range(len(vocab), VOCAB):  # fill the model's vocabulary so every generated id decodes
        vocab[f"w{i}"] = i
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="[BOS]", eos_token="[EOS]",
                                        unk_token="[UNK]", pad_token="[PAD]")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}assistant : {% endif %}")
    return tokenizer


SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``<pad> <s> </s> <unk> w4 ... w{vocab_size - 1}``."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


class FakeTokenizer:
    """A vocabulary and nothing else: what n-gram tables fingerprint a tokenizer by."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


# -- the command line -------------------------------------------------------------------------------------------------

def save_model(folder, seed: int, *, vocab: int = VOCAB, tokenizer_vocab: int | None = None,
               max_positions: int = 256) -> str:
    """A tiny Llama and a :func:`word_tokenizer` saved into ``folder``, as a real model folder is laid out."""
    tiny_llama(seed, vocab=vocab, max_positions=max_positions).save_pretrained(folder)
    word_tokenizer(tokenizer_vocab or vocab).save_pretrained(folder)
    return str(folder)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``jointspec`` with ``args``, argparse's SystemExit included."""
    from jointspec.cli.main import main

    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_clean_error(code: int, err: str, *needles: str) -> None:
    """A non-zero exit, no traceback, and a final error line that mentions every needle."""
    assert code not in (0, None), err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "error:" in last, err
    for needle in needles:
        assert needle in last, last


def train_cli_argv(monkeypatch, target_model, tmp_path, out: str) -> list[str]:
    """``train-draft`` options for a quick run on the tiny target (patched in) with 18 text prompts into ``out``."""
    from jointspec.cli import train as train_cli

    monkeypatch.setattr(train_cli, "load_target",
                        lambda *args, **kwargs: (CausalLM(target_model, name="tiny-target"), tiny_tokenizer()))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"please answer question {word} python" for word in
                                 ["one", "two", "more", "short", "value", "return"] * 3))
    return ["train-draft", "--out", str(tmp_path / out), "--prompts", str(prompts), "--max-new-tokens", "24",
            "--epochs", "3", "--eval-every", "5", "--batch-tokens", "256", "--draft-vocab", "50", "--no-progress"]


# -- trained drafts ---------------------------------------------------------------------------------------------------

def untrained_draft_of(module_class, config_class, target: CausalLM, seed: int = 0,
                       draft_vocab_size: int | None = None, **shape):
    """A freshly initialised trained-draft module (a head, a distilled draft) for ``target``."""
    from jointspec.drafts.artifact import target_fingerprint

    torch.manual_seed(seed)
    config = config_class.for_target(target, target_fingerprint(target), draft_vocab_size=draft_vocab_size, **shape)
    draft = module_class(config).eval()
    if draft_vocab_size:
        # Every other token, so some target tokens are outside the draft vocabulary.
        draft.draft_vocab.copy_(torch.arange(0, 2 * draft_vocab_size, 2)[:draft_vocab_size])
    return draft


def untrained_head(target: CausalLM, seed: int = 0, draft_vocab_size: int | None = None):
    """A freshly initialised EAGLE head (:class:`jointspec.drafts.eagle.EagleHead`) for ``target``."""
    from jointspec.drafts.artifact import HeadConfig
    from jointspec.drafts.eagle import EagleHead

    return untrained_draft_of(EagleHead, HeadConfig, target, seed, draft_vocab_size)


def tiny_training_data(tmp_path_factory, target_model):
    """The tiny target's own greedy continuations of 48 random prompts, with its features (a few seconds)."""
    from jointspec.train.data import build_data

    target = CausalLM(target_model, name="tiny-target")
    prompts = [random_prompt(100 + i, length=8) for i in range(48)]
    data = tmp_path_factory.mktemp("data")
    build_data(target, None, prompts, data, max_new_tokens=40, max_length=128, shard_size=16, batch_size=8)
    return data


def sps_acceptance(target_model, folder, num_draft_tokens: int = 4) -> float:
    """Share of drafted tokens ``sps`` accepts with the draft in ``folder``, on six prompts no tiny draft was trained
    on (see :func:`tiny_training_data`)."""
    # At a fixed length: a cost-aware length would follow the machine's timings.
    decoder = decoder_for(target_model, "sps", folder, num_draft_tokens=num_draft_tokens, cost_aware=False)
    accepted = drafted = 0
    for seed in range(200, 206):
        decoder.generate(random_prompt(seed, length=8), greedy(40))
        accepted += decoder.stats.num_accepted_tokens
        drafted += decoder.stats.num_draft_tokens
    return accepted / drafted


class RecordingVerifier:
    """A decoder's verifier that keeps what it said last (``last``: the round's Verdict), all else passed through."""

    def __init__(self, inner) -> None:
        self.inner, self.last = inner, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, *args, **kwargs):
        self.last = self.inner.verify(*args, **kwargs)
        return self.last


def assert_greedy_equivalent(target_model, decoder: SpeculativeDecoder, prompt: list[int], *,
                             drafts_kept: bool | None = None) -> None:
    """``decoder`` gives transformers' greedy output, also when max length or EOS falls inside a draft.

    Both cases are placed from the decoder's own rounds (greedy drafting is deterministic: build the decoder with
    ``cost_aware=False``, whose timings would move its drafts): a length and an end-of-sequence token strictly inside
    a round that kept drafted tokens, so verification keeps tokens past them and the loop must cut; the EOS case
    checks that it did. A token ends the answer where it is first seen, and a tiny model's answer soon repeats
    itself, so where no token is first seen inside such a round, the same case is looked for after the prompt
    followed by the answer's first tokens (another prompt, as good as any). ``drafts_kept=False``: a decoder whose
    drafts may all be rejected (an untrained head): the cases fall back to fixed positions, which then test nothing
    inside a draft; None: False for a cost-aware drafter (its timings decide whether it drafts), else True."""
    from jointspec.drafters.costaware import CostAwareDrafter

    if drafts_kept is None:
        drafts_kept = not isinstance(decoder.drafter, CostAwareDrafter)
    expected = hf_greedy(target_model, prompt, 40)
    rounds = list(decoder.stream(prompt, greedy(40)))
    assert [token for chunk in rounds for token in chunk] == expected
    several = _rounds_kept(rounds)
    assert several or not drafts_kept, f"no round kept a drafted token ({len(rounds)} rounds of one token)"
    # Max length inside a draft: a budget that ends inside a round of the whole answer (its draft must be cut short).
    for length in sorted({b - 1 for _, b in several})[:3] or [7]:
        assert decoder.generate(prompt, greedy(length)) == expected[:length]
    # EOS inside a draft: a token first seen inside such a round, not its last, is the end of sequence.
    recorder = RecordingVerifier(decoder.verifier)
    decoder.verifier = recorder
    try:
        for lead in (0, 6, 12, 18, 24):
            start = prompt + expected[:lead]
            answer = hf_greedy(target_model, start, 40) if lead else expected
            rounds = rounds if not lead else list(decoder.stream(start, greedy(40)))
            first_seen = {token: i for i, token in reversed(list(enumerate(answer)))}
            inside = [q for a, b in _rounds_kept(rounds) for q in range(a, b - 1) if first_seen[answer[q]] == q]
            if inside or not drafts_kept:
                break
        assert inside or not drafts_kept, "no token is first seen inside a kept draft after any of the prompts tried"
        cut = False
        for position in inside[:3] or [expected.index(expected[9])]:
            tail = list(decoder.stream(start, greedy(40, frozenset({answer[position]}))))
            assert [token for chunk in tail for token in chunk] == answer[:position + 1]
            cut = cut or len(recorder.last.token_ids) > len(tail[-1])
        assert cut or not drafts_kept, "verification never kept tokens past the end of sequence: nothing was cut"
    finally:
        decoder.verifier = recorder.inner


def _rounds_kept(rounds: list[list[int]]) -> list[tuple[int, int]]:
    """(first, end) answer positions of each round that committed several tokens (kept drafted tokens)."""
    spans, start = [], 0
    for chunk in rounds:
        if len(chunk) >= 2:
            spans.append((start, start + len(chunk)))
        start += len(chunk)
    return spans


def fp16_rounded(module):
    """A copy of ``module`` whose state (its ``state_dict``: weights and persistent buffers, what a saved draft
    artifact holds) is rounded to float16 and back, as drafts/artifact.py stores it. Buffers computed at construction
    (rotary frequencies) are not stored, so they stay as they are."""
    import copy

    rounded = copy.deepcopy(module)
    rounded.load_state_dict({name: tensor.half().float() if tensor.is_floating_point() else tensor
                             for name, tensor in module.state_dict().items()})
    return rounded


def assert_artifact_round_trip(module, folder, load):
    """``module`` (a trained-draft module: head, heads, distilled draft) saved into ``folder`` and loaded back by
    ``load``: the same tensors under the same names, each bit for bit the module's own rounded to float16 (the
    placeholder token embedding, which drafts read from the target, is not stored). Returns the loaded module."""
    module.save(folder)
    loaded, _ = load(folder)

    def stored(state):
        return {name: tensor for name, tensor in state.items() if not name.startswith("body.embed_tokens")}

    expected = {name: tensor.half().float() if tensor.is_floating_point() else tensor
                for name, tensor in stored(module.state_dict()).items()}
    got = stored(loaded.state_dict())
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    return loaded


def assert_loads_to_the_same_decoding(target_model, folder, prompt: list[int]) -> None:
    """Two loads of the draft in ``folder`` give the same tokens and the same number of accepted drafts."""
    runs = []
    for _ in range(2):
        decoder = decoder_for(target_model, "sps", folder, num_draft_tokens=4, cost_aware=False)
        runs.append((decoder.generate(prompt, greedy(30)), decoder.stats.num_accepted_tokens))
    assert runs[0] == runs[1]


# -- the bench and the batched engine ---------------------------------------------------------------------------------

def run_tiny(target_model, tokenizer, methods: str, prompts, **config):
    """``jointspec bench``'s runner on the tiny target: (result, summary) for ``methods`` (a spec string)."""
    from jointspec.bench.report import summarise
    from jointspec.bench.runner import BenchConfig, run_bench
    from jointspec.bench.specs import parse_specs

    target = CausalLM(target_model, name="tiny-target")
    settings = dict(max_new_tokens=12, cost_model=False) | config
    result = run_bench(target, tokenizer, prompts, parse_specs(methods), "ar", BenchConfig(**settings),
                       progress=False)
    return result, summarise(result)


def make_batch_prompts(count: int = 16, seed: int = 0) -> list[list[int]]:
    """Prompts of 1 to 29 tokens, every other one a repeated motif (so prompt lookup finds drafts)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        length = 1 + (i * 7) % 29
        motif = [rng.randint(3, 98) for _ in range(max(1, length // 3))]
        prompts.append((motif * 4)[:length] if i % 2 else [rng.randint(3, 98) for _ in range(length)])
    return prompts


# The batched engine's settings (tests/test_batch.py says why each was chosen).
BATCH_PROMPTS = make_batch_prompts()
BATCH_EOS = frozenset({2, 7})
BATCH_GREEDY = DecodeConfig(max_new_tokens=20, eos_token_ids=BATCH_EOS)
BATCH_SAMPLED = DecodeConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=0.8, top_k=50),
                             eos_token_ids=BATCH_EOS)
# One method of each kind of round, at fixed draft lengths (so a seed draws the same): a chain without draft
# probabilities, a model draft's chain, a tree whose accepted path is not rows 1, 2, ..., and MTAD's joint test. The
# tests of what every method's rows get (log-probabilities, penalties) run them all.
ROUND_KINDS = {
    "ar": MethodConfig("ar"),
    "pld": MethodConfig("pld", num_draft_tokens=4),
    "sps-self": MethodConfig("sps", draft="self", num_draft_tokens=3, cost_aware=False),
    "specinfer-self": MethodConfig("specinfer", draft="self", tree=(2, 2)),
    "mtad-self": MethodConfig("mtad", draft="self", num_draft_tokens=3, beam_width=2, cost_aware=False),
}
# The ragged engine batches a method's inner drafter (batch/drafters.py): sps at its fixed length, so the single loop
# it is held to drafts the same.
BATCH_METHODS = {
    "ar": MethodConfig("ar"),
    "pld": MethodConfig("pld", num_draft_tokens=4),
    "sps-self": MethodConfig("sps", draft="self", num_draft_tokens=4, cost_aware=False),
    "sps-other": MethodConfig("sps", draft="other", num_draft_tokens=3, cost_aware=False),
}


# SpecBench's question.jsonl layout: two categories, a two-turn question, an extra key the bench ignores.
SPEC_BENCH_LINES = [
    {"question_id": 1, "category": "summary", "turns": ["summarise the text : bees warm the nest with wings",
                                                         "now make it one short line"]},
    {"question_id": 2, "category": "summary", "turns": ["rewrite this text for a user : the hive is warm"]},
    {"question_id": "c1", "category": "code", "turns": ["add a type hint to this python function : def total "
                                                          "( price ) : return price", ],
     "reference": ["ignored"]},
]


# -- the server -------------------------------------------------------------------------------------------------------

SERVER_CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
SERVER_TIMEOUT = 30.0  # seconds: every wait on a live server ends, pass or fail


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens + <pad>, <s>, </s> (259 ids, for ``tiny_llama(seed, vocab=259)``): any text, multi-byte
    characters included, round-trips."""
    from tokenizers import decoders
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_char = bytes_to_unicode()
    vocab = {to_char[b]: b for b in range(256)} | {"<pad>": 256, "<s>": 257, "</s>": 258}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    tokenizer.chat_template = SERVER_CHAT_TEMPLATE
    return tokenizer


def grammar_takes(engine, use, text: str) -> bool:
    """Whether the grammar of tool use ``use`` (server/tools.py; or an OutputFormat) lets an answer be ``text``
    (tokenized as the engine's tokenizer reads it: a special token's spelling as that token) and then end."""
    state = engine.grammar(use if isinstance(use, OutputFormat) else use.output_format()).start()
    for token in engine.tokenizer(text, add_special_tokens=False)["input_ids"]:
        if not state.allowed()[token]:
            return False
        state.advance([token])
    return bool(state.allowed()[sorted(engine.eos_token_ids)].any())


def sse_events(text: str) -> list[dict]:
    """The JSON events of a streamed reply's body (server-sent events), less the closing ``[DONE]``."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def streamed_calls(client, body: dict) -> tuple[list[dict], str, str]:
    """A chat request (``body``) streamed through a test client: the functions of the calls its deltas carry, the
    content they carry, and the last finish reason."""
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    deltas = [event["choices"][0]["delta"] for event in events]
    return ([call["function"] for delta in deltas for call in delta.get("tool_calls", [])],
            "".join(delta.get("content") or "" for delta in deltas), events[-1]["choices"][0]["finish_reason"])


# A tool whose one value is an enum's: a random model, let write a free value, writes until its length runs out.
CITY_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
# Another, of an integer enum; and a conversation with an earlier call of CITY_TOOL and its result: what the call
# formats' tests share.
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
                                  "additionalProperties": False}}}
EARLIER_CALL = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "user", "content": "And Rome?"}]


def engine_of(model, tokenizer):
    """A module fixture's serving engine over ``model`` (``yield from`` it): closed when the module is done."""
    from jointspec.server.engine import ServingEngine

    served = ServingEngine(CausalLM(model), tokenizer, model_id="tiny", max_batch_size=4)
    yield served
    served.close()


def check_streamed_calls(use, text: str, content: str, num_calls: int) -> None:
    """``text`` streamed through a call stream a character and four at a time sends ``content`` as it comes and
    ends with ``num_calls`` calls and nothing held."""
    from jointspec.server.tools import CallStream

    for size in (1, 4):
        stream = CallStream(use)
        sent = "".join(stream.feed(text[at:at + size]) for at in range(0, len(text), size))
        rest, calls = stream.finish()
        assert sent == content and rest == "" and len(calls) == num_calls, size


def check_required_call(engine, model, call_format: str, method: str, max_tokens: int = 120) -> None:
    """A required call of :data:`CITY_TOOL` through the server on ``engine`` (whose template writes calls in
    ``call_format``), whole and streamed, is the call plain constrained greedy decoding of ``model`` gives the same
    prompt (every method decodes a grammar losslessly), read from its text with the format's markers kept."""
    from fastapi.testclient import TestClient

    from jointspec.backends.tokens import chat_template_ids, decode_text
    from jointspec.core.draft import NoDrafter
    from jointspec.server.app import ServerSettings, create_app
    from jointspec.server.tools import prompt_messages, read_calls, read_tool_use
    from jointspec.verifiers.greedy import GreedyVerifier

    client = TestClient(create_app(ServerSettings(), engine))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0,
            "max_tokens": max_tokens, "tools": [CITY_TOOL], "tool_choice": "required", "parallel_tool_calls": False,
            "jointspec": {"method": method}}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    use = read_tool_use([CITY_TOOL], "required", False, call_format=call_format, special=engine.call_markers)
    prompt = chat_template_ids(engine.tokenizer, *prompt_messages(body["messages"], use.shown(), True, call_format))
    loop = SpeculativeDecoder(CausalLM(model), NoDrafter(), GreedyVerifier())
    ids = loop.generate(prompt, DecodeConfig(max_tokens, eos_token_ids=engine.eos_token_ids,
                                             grammar=engine.grammar(use.output_format())))
    expected = read_calls(decode_text(engine.tokenizer, ids, {i: t for t, i in engine.call_markers}), use)
    # (content: none, or what a byte model's end-of-sequence byte spells, where its config names one)
    assert expected.calls and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == \
        expected.content
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [c["function"] for c in expected.calls]
    functions, content, finish = streamed_calls(client, body)
    assert functions == [c["function"] for c in expected.calls] and finish == "tool_calls"
    assert content.strip() == (expected.content or "").strip()


def llama_ending_at_eos(seed: int, vocab: int, max_positions: int = 1024):
    """:func:`tiny_llama` whose end of sequence is :func:`byte_tokenizer`'s ``</s>`` (a special token, as real models'
    are), not the byte the test models' config names, which a decode would spell and a grammar's text may hold."""
    llama = tiny_llama(seed, vocab=vocab, max_positions=max_positions)
    llama.config.eos_token_id = llama.generation_config.eos_token_id = byte_tokenizer().eos_token_id
    return llama


def tokenizer_with(template: str | dict):
    """:func:`byte_tokenizer` with a chat template of a test's own (a new tokenizer: the fixtures' are shared)."""
    words = byte_tokenizer()
    words.chat_template = template
    return words


def assert_stream_adds_up(opened: bool, text: str, tags) -> None:
    """A reasoning stream (server/reasoning.py) sends, fed ``text`` cut at any one place or a character at a time,
    what the whole answer's split has: its reasoning (none read as "") and its content."""
    from jointspec.server.reasoning import ReasoningStream, split_reasoning

    whole = split_reasoning(text, opened, tags)
    for pieces in [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]:
        stream = ReasoningStream(opened, tags)
        sent = [stream.feed(piece, final=number == len(pieces) - 1) for number, piece in enumerate(pieces)]
        assert "".join(r for r, _ in sent) == (whole.reasoning or "") and "".join(
            c for _, c in sent) == whole.content, pieces


@contextlib.contextmanager
def live_server(app, make_server=None):
    """uvicorn on 127.0.0.1 on a free port, in a thread; yields (base URL, server) and stops when the block ends.
    ``make_server(config)`` builds the server (default: ``uvicorn.Server``)."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
    server = (make_server or uvicorn.Server)(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_TIMEOUT
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(SERVER_TIMEOUT)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def model_joint_law(model, prompt: list[int], sampling, num_tokens: int) -> dict[tuple[int, ...], float]:
    """A transformers model's law of its first ``num_tokens`` tokens after ``prompt`` under ``sampling`` (a
    SamplingConfig: top-k keeps the enumeration small), by enumeration: {tokens: probability}."""
    from jointspec.core.sampling import processed_probs

    law = {(): 1.0}
    for _ in range(num_tokens):
        grown = {}
        for prefix, p in law.items():
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + list(prefix)], device=model.device)).logits[0, -1]
            probs = processed_probs(logits, sampling).double().cpu()
            for token in torch.nonzero(probs).flatten().tolist():
                grown[prefix + (token,)] = p * float(probs[token])
        law = grown
    return law


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (same shape, probs summing to 1)."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel() / probs.sum()
    impossible = probs < 1e-12
    if counts[impossible].sum() > 0:
        return 0.0  # a token the law forbids was emitted
    counts, probs = counts[~impossible], probs[~impossible]
    expected = probs * counts.sum()
    small = expected < 5
    if small.any():  # pool rare cells into one so that every cell is expected at least 5 times
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(counts) < 2:
        return 1.0  # a single possible outcome, and it is the only one observed
    return float(stats.chisquare(counts, expected).pvalue)


def record_curve_store(monkeypatch) -> tuple[list, list]:
    """From now on, what the cost-curve store reads (each curve read back, None where nothing was kept) and the paths
    it would write (nothing is written): drafters/curve_store.py, for tests of commands that keep their curves."""
    from jointspec.drafters import curve_store

    read, written, read_kept = [], [], curve_store.read

    def recording_read(path):
        read.append(read_kept(path))
        return read[-1]

    monkeypatch.setattr(curve_store, "read", recording_read)
    monkeypatch.setattr(curve_store, "write", lambda path, costs: written.append(path))
    return read, written
