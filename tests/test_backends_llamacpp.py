"""The llama.cpp backend: the adapter, greedy equivalence through jointspec's loop, the bench engines, the errors.

Everything runs on a tiny GGUF written here from a tiny random Llama (2 layers, hidden 32, fp32 weights) with a
byte-level BPE vocabulary of 263 tokens (3 control tokens, the 256 byte symbols, 4 merges), laid out as llama.cpp's
own converter lays out a Llama: q/k rows permuted for llama.cpp's rope, tokenizer metadata as ``gpt2``.
transformers reads the same file back (the tokenizer the adapter checks against, and the torch model the logits
are compared with).

Tolerances, measured on 8 random 40-token prompts (logits span about +-4; the adapter's default flash attention):
- llama.cpp against itself in another batch shape (40 single-token forwards vs one 40-token forward, fed as 32 + 8):
  at most 5.3e-5; ``ATOL_SELF`` = 2e-4. In fp32 a batched forward may sum in another order, so not bit-equal.
- llama.cpp against torch fp32 on the same weights: at most 1.05e-3, because llama.cpp stores its KV cache in fp16;
  ``ATOL_TORCH`` = 3e-3. A position off by one or a stale cache entry moves logits by ~0.1 to 1, far outside it.
The gap between the top two logits of a row goes down to 4e-4 on these prompts (263 tokens, lm_head scaled by 8 as
in conftest), inside the llama.cpp-vs-torch noise. So argmax is compared with torch only on rows whose torch margin
exceeds ``4 * ATOL_TORCH`` (a near-tie may legitimately flip there), and greedy *sequences* are compared only within
llama.cpp, where the noise is 8 times below the smallest margin seen: speculative greedy on the adapter must equal
plain greedy on the adapter token for token (a draft token is kept only when it is the argmax of the batch that
verified it), and those tests are exact. Their reference is greedy decoding by hand on the adapter's exact context:
``ar`` runs on its plain context (flash attention off), whose logits differ from the exact context's by up to 1e-3,
so it is compared only with greedy decoding on kernels of its own kind (the bench test is the one exception, see
there). (On the real Q4_1 model, batched and single-token rows are bit-identical with flash attention, and differ
by up to ~1 without it: see jointspec.backends.llamacpp.)
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install 'jointspec[llamacpp]'): the llama.cpp "
                        "backend cannot be tested without it")

from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

from jointspec.backends import embedded
from jointspec.backends.hf import CausalLM
from jointspec.backends.llamacpp import LlamaCppLM, LlamaCppWeights, check_vocabulary, load_llamacpp
from jointspec.bench.prompts import BenchPrompt
from jointspec.bench.runner import BenchConfig, run_bench
from jointspec.bench.specs import MethodSpecError, parse_spec, parse_specs
from jointspec.core.errors import ContextTooLongError, ModelLoadError, UnsupportedOptionError
from jointspec.core.loop import SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import greedy  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0 (pad), 1 (bos), 2 (eos), as in SmolLM2
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
ATOL_SELF = 2e-4  # llama.cpp vs itself in another batch shape (module docstring)
ATOL_TORCH = 3e-3  # llama.cpp (fp16 KV cache) vs torch fp32 on the same weights
MAX_NEW_TOKENS = 40
NUM_DRAFT_TOKENS = 4


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + list(bytes_to_unicode().values()) + ["".join(m) for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))  # 3 = control, 1 = normal
    return tokens, types


def tiny_model(seed: int, vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper logits: no near-ties (module docstring)
    return model


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's rope rotates adjacent pairs, HF's rotates halves: llama.cpp's converter reorders q/k rows so.
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(path: Path, model: LlamaForCausalLM, tokens: list[str], types: list[int]) -> Path:
    """``model`` as an fp32 llama GGUF with a byte-level BPE tokenizer of ``tokens``."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        for name, key in [("attn_norm", "input_layernorm"), ("attn_v", "self_attn.v_proj"),
                          ("attn_output", "self_attn.o_proj"), ("ffn_norm", "post_attention_layernorm"),
                          ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]:
            writer.add_tensor(f"blk.{i}.{name}.weight", weights[f"{layer}{key}.weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", _permute(weights[f"{layer}self_attn.q_proj.weight"], heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _permute(weights[f"{layer}self_attn.k_proj.weight"], kv_heads))
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf path, torch model with the same weights)."""
    tokens, types = tiny_vocab()
    model = tiny_model(0, len(tokens))
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, tokens, types), model


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_llamacpp(str(tiny[0]), n_threads=1, n_ctx=256, name="tiny-llamacpp")


@pytest.fixture()
def lm(loaded) -> LlamaCppLM:
    loaded[0].reset()
    return loaded[0]


def random_prompt(seed: int, length: int = 12) -> list[int]:
    """Random ids above the special ones (0 pad, 1 bos, 2 eos)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 263, (length,), generator=generator).tolist()


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values  # [rows, 2]
    return top[:, 0] - top[:, 1]  # [rows]


# --- the adapter ---------------------------------------------------------------------------------------------------

def test_loader_reports_sizes(loaded, tiny):
    lm, tokenizer = loaded
    assert lm.vocab_size == len(tokenizer) == 263
    assert lm.max_context == 256  # min(n_ctx, the trained context of the file)
    assert lm.device == torch.device("cpu") and lm.dtype == torch.float32
    assert lm.name == "tiny-llamacpp"
    assert tokenizer.eos_token_id == 2


def test_chain_forward_matches_single_token_forwards_and_torch(lm, tiny):
    prompt = random_prompt(0)
    batched = lm.forward(prompt).logits  # [12, vocab]
    assert batched.shape == (12, 263) and batched.dtype == torch.float32
    assert lm.num_cached == 12
    lm.reset()
    single = torch.cat([lm.forward([t]).logits for t in prompt])  # [12, vocab]
    torch.testing.assert_close(batched, single, atol=ATOL_SELF, rtol=0)
    assert torch.equal(batched.argmax(-1), single.argmax(-1))
    reference = tiny[1](torch.tensor([prompt])).logits[0].detach()  # [12, vocab] torch fp32, same weights
    torch.testing.assert_close(batched, reference, atol=ATOL_TORCH, rtol=0)
    clear = top2_margins(reference) > 4 * ATOL_TORCH  # rows with a clear winner must agree on it
    assert clear.sum() >= 8
    assert torch.equal(batched.argmax(-1)[clear], reference.argmax(-1)[clear])


def test_num_logits_selects_last_rows_and_still_caches(lm):
    prompt = random_prompt(3)
    full = lm.forward(prompt).logits
    lm.reset()
    last3 = lm.forward(prompt, num_logits=3).logits
    torch.testing.assert_close(last3, full[-3:], atol=ATOL_SELF, rtol=0)
    lm.reset()
    none = lm.forward(prompt[:-1], num_logits=0).logits
    assert none.shape == (0, 263) and lm.num_cached == len(prompt) - 1
    torch.testing.assert_close(lm.forward(prompt[-1:]).logits, full[-1:], atol=ATOL_SELF, rtol=0)


def test_crop_then_reforward_reproduces_logits(lm):
    prompt = random_prompt(5)
    full = lm.forward(prompt).logits
    lm.crop(8)
    assert lm.num_cached == 8
    again = lm.forward(prompt[8:]).logits
    assert torch.equal(again.argmax(-1), full[8:].argmax(-1))
    torch.testing.assert_close(again, full[8:], atol=ATOL_SELF, rtol=0)
    # Crop past a different continuation: the dropped tokens must leave no trace in the cache.
    lm.crop(6)
    lm.forward(random_prompt(9, length=5))
    lm.crop(6)
    torch.testing.assert_close(lm.forward(prompt[6:]).logits, full[6:], atol=ATOL_SELF, rtol=0)
    lm.crop(0)
    torch.testing.assert_close(lm.forward(prompt).logits, full, atol=ATOL_SELF, rtol=0)
    with pytest.raises(ValueError, match="cannot crop"):
        lm.crop(lm.num_cached + 1)


def test_forward_longer_than_n_batch_is_split(loaded):
    # A 5-token batch limit: 13 tokens go in three decodes, and the 7 rows asked for span the last two.
    lm = loaded[0]
    small = LlamaCppLM(lm.model, n_ctx=64, n_threads=1, n_batch=5, name="small-batches")
    prompt = random_prompt(6, length=13)
    lm.reset()
    expected = lm.forward(prompt).logits[-7:]
    got = small.forward(prompt, num_logits=7).logits
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(got, expected, atol=ATOL_SELF, rtol=0)
    assert small.num_cached == 13


def test_verify_batches_are_capped_and_prefills_are_not(lm, monkeypatch):
    # Rows of a batch longer than EXACT_BATCH stop matching single-token decoding on real models (module docstring
    # of jointspec.backends.llamacpp), so a forward returning several rows of logits is fed in pieces.
    from jointspec.backends.llamacpp import EXACT_BATCH

    sizes: list[int] = []
    decode = llama_cpp.llama_decode

    def recording_decode(context, batch):
        sizes.append(batch.n_tokens)
        return decode(context, batch)

    monkeypatch.setattr(lm._lib, "llama_decode", recording_decode)
    prompt = random_prompt(2, length=EXACT_BATCH + 8)
    full = lm.forward(prompt).logits
    assert sizes == [EXACT_BATCH, 8]
    sizes.clear()
    lm.reset()
    last = lm.forward(prompt, num_logits=1).logits
    lm.reset()
    lm.forward(prompt, num_logits=0)
    assert sizes == [EXACT_BATCH + 8] * 2
    torch.testing.assert_close(last, full[-1:], atol=ATOL_SELF, rtol=0)


def test_trees_hidden_states_and_scattered_keeps_are_refused(lm):
    with pytest.raises(UnsupportedOptionError, match="tree methods are not supported on the llama.cpp backend"):
        lm.forward([5, 6, 7], parents=[-1, -1, 0])
    assert lm.num_cached == 0  # nothing was fed
    with pytest.raises(UnsupportedOptionError, match="no hidden states"):
        lm.forward([5], output_hidden=True)
    lm.forward([5, 6, 7], parents=[-1, 0, 1])  # a chain given as parents is fine
    with pytest.raises(UnsupportedOptionError, match="tree methods"):
        lm.keep([0, 2])
    lm.keep([0, 1])
    assert lm.num_cached == 2
    with pytest.raises(ValueError, match="at least one token"):
        lm.forward([])


def test_context_overflow_is_refused(lm):
    lm.forward(random_prompt(0, length=250), num_logits=0)
    with pytest.raises(ContextTooLongError, match="256"):
        lm.forward(random_prompt(1, length=7))
    assert lm.num_cached == 250


# --- greedy equivalence through the loop ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def other_draft():
    """A different random torch model as the draft: it almost never agrees, so nearly every round rolls back."""
    return CausalLM(tiny_model(1, 263), name="tiny-torch-other")


def make_decoder(method: str, lm: LlamaCppLM, tokenizer, other: CausalLM | None = None,
                 num_draft_tokens: int = NUM_DRAFT_TOKENS) -> SpeculativeDecoder:
    """Built by the method registry, as the bench builds it. ``sps-self`` drafts with a fork of the adapter (its
    own llama.cpp context over the same weights), ``sps-other`` with a different torch model."""
    name, draft = {"ar": ("ar", None), "pld": ("pld", None), "sps-self": ("sps", "fork"),
                   "sps-other": ("sps", "other")}[method]

    def load_draft(source: str):
        return (lm.fork("tiny-fork"), tokenizer) if source == "fork" else (other, None)

    # A fixed draft length: these tests are about the adapter under drafts (its roll-back above all), and on
    # llama.cpp's steep cost curve a cost-aware `sps` would rarely draft from a draft this poor.
    config = MethodConfig(name=name, draft=draft, num_draft_tokens=num_draft_tokens, cost_aware=False)
    drafter, verifier = build_method(MethodContext(config, lm, tokenizer, load_draft))
    return SpeculativeDecoder(lm, drafter, verifier)


def plain(lm, tokenizer, prompt, max_new_tokens, eos=frozenset()) -> list[int]:
    """Greedy decoding through the loop (``ar``: on the adapter's plain context, flash attention off)."""
    return make_decoder("ar", lm, tokenizer).generate(prompt, greedy(max_new_tokens, eos))


def exact_greedy(lm: LlamaCppLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding one forward per token on the adapter's exact context (what verification runs on), by hand."""
    lm.reset()
    lm.forward(prompt[:-1], num_logits=0)
    out = [prompt[-1]]
    for _ in range(max_new_tokens):
        out.append(int(lm.forward(out[-1:]).logits[-1].argmax()))
    return out[1:]


METHODS = ["pld", "sps-self", "sps-other"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("prompt_seed", [3, 6])
def test_methods_match_plain_greedy(loaded, other_draft, method, prompt_seed):
    lm, tokenizer = loaded
    prompt = random_prompt(prompt_seed)
    expected = exact_greedy(lm, prompt, MAX_NEW_TOKENS)
    decoder = make_decoder(method, lm, tokenizer, other_draft)
    assert decoder.generate(prompt, greedy(MAX_NEW_TOKENS)) == expected
    stats = decoder.stats
    assert stats.num_new_tokens == MAX_NEW_TOKENS
    assert stats.num_rounds + stats.num_accepted_tokens == MAX_NEW_TOKENS
    if method == "sps-self":  # a fork of the target proposes the target's own argmax: all accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    if method == "sps-other":  # the roll-back path, nearly every round
        assert stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.25


@pytest.mark.parametrize("method", ["ar", "sps-self"])
def test_log_probabilities_are_the_adapters_own_rows(loaded, method):
    """llama.cpp's rows are whole (no screen): each committed token's log-probability is its row's, as a forward per
    token on the context that decoded it gives it (``ar``'s plain context: flash attention off; to float rounding of
    another batch shape: 1e-4)."""
    lm, tokenizer = loaded
    prompt = random_prompt(3)
    decoder = make_decoder(method, lm, tokenizer)
    tokens = decoder.generate(prompt, replace(greedy(MAX_NEW_TOKENS), logprobs=2))
    assert [f.token_id for f in decoder.logprobs] == tokens
    reference = LlamaCppLM(lm.model, n_ctx=lm.max_context, n_threads=1, flash_attn=False) if method == "ar" else lm
    reference.reset()
    reference.forward(prompt[:-1], num_logits=0)
    expected = []
    for previous, token in zip([prompt[-1]] + tokens, tokens):
        expected.append(float(torch.log_softmax(reference.forward([previous]).logits[-1].double(), -1)[token]))
    assert [f.logprob for f in decoder.logprobs] == pytest.approx(expected, abs=1e-4)
    assert all(len(f.top) == 2 and f.top[0][0] == f.token_id for f in decoder.logprobs)  # greedy: the top token


@pytest.mark.parametrize("prompt_seed", [3, 6])
def test_ar_decodes_on_the_plain_context_and_speculation_on_the_exact_one(loaded, prompt_seed):
    # ar verifies nothing, so the loop lets the adapter run it on llama.cpp's default kernels (flash attention off):
    # its tokens are those of greedy decoding by hand on an adapter made without flash attention (same kernels, so
    # bit-identical logits). A speculative decode afterwards must switch back to the exact context. (The two
    # contexts' logits differ by up to ~7e-4, above the smallest top-two margins here, so ar is not compared with
    # pld.)
    lm, tokenizer = loaded
    prompt = random_prompt(prompt_seed)
    no_flash = LlamaCppLM(lm.model, n_ctx=lm.max_context, n_threads=1, flash_attn=False)
    assert plain(lm, tokenizer, prompt, MAX_NEW_TOKENS) == exact_greedy(no_flash, prompt, MAX_NEW_TOKENS)
    assert lm.plain
    pld = make_decoder("pld", lm, tokenizer)
    assert pld.generate(prompt, greedy(MAX_NEW_TOKENS)) == exact_greedy(lm, prompt, MAX_NEW_TOKENS)
    assert not lm.plain


def test_cost_curve_is_measured_on_the_exact_context_after_ar(loaded):
    # Building a cost-aware method measures verification costs (multi-row forwards), which the plain context
    # refuses; an ar decode just before must not make that fail.
    from jointspec.drafters import costaware

    lm, tokenizer = loaded
    prompt = random_prompt(3)
    plain(lm, tokenizer, prompt, 4)
    assert lm.plain
    costaware._MEASURED.pop(lm.model, None)  # measure now, not from an earlier test's memo
    config = MethodConfig(name="pld", cost_aware=True, num_draft_tokens=NUM_DRAFT_TOKENS)
    drafter, verifier = build_method(MethodContext(config, lm, tokenizer, None))
    decoder = SpeculativeDecoder(lm, drafter, verifier)
    assert decoder.generate(prompt, greedy(MAX_NEW_TOKENS)) == exact_greedy(lm, prompt, MAX_NEW_TOKENS)


def test_plain_context_runs_without_flash_attention_and_refuses_verification(loaded):
    lm, _ = loaded
    prompt = random_prompt(4)
    lm.reset(plain=True)
    plain_rows = torch.cat([lm.forward([t]).logits for t in prompt])  # [12, vocab]
    no_flash = LlamaCppLM(lm.model, n_ctx=lm.max_context, n_threads=1, flash_attn=False)
    reference = torch.cat([no_flash.forward([t]).logits for t in prompt])
    assert torch.equal(plain_rows, reference)  # same kernels, same inputs: bit-identical
    lm.reset()
    exact_rows = torch.cat([lm.forward([t]).logits for t in prompt])
    assert not torch.equal(plain_rows, exact_rows)  # the other kernels really ran
    torch.testing.assert_close(plain_rows, exact_rows, atol=ATOL_TORCH, rtol=0)  # both within fp16-KV noise
    lm.reset(plain=True)
    lm.forward(prompt[:4], num_logits=1)
    with pytest.raises(RuntimeError, match="reset\\(\\) without plain=True"):
        lm.forward(prompt[4:7])
    lm.set_threads(2)  # reaches both contexts
    assert llama_cpp.llama_n_threads(lm._exact.pointer) == llama_cpp.llama_n_threads(lm._fast.pointer) == 2
    lm.set_threads(1)


def test_prompt_lookup_accepts_on_repetitive_prompt(loaded):
    lm, tokenizer = loaded
    seed_prompt = random_prompt(1)
    prompt = seed_prompt + exact_greedy(lm, seed_prompt, 24) + seed_prompt
    decoder = make_decoder("pld", lm, tokenizer)
    assert decoder.generate(prompt, greedy(MAX_NEW_TOKENS)) == exact_greedy(lm, prompt, MAX_NEW_TOKENS)
    assert decoder.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_eos_inside_draft_stops_like_plain_greedy(loaded, other_draft, method):
    # As in test_core_loop_equivalence: declare as EOS tokens whose first occurrence falls inside a draft (not on a
    # bonus
    # token, not in round one), so the loop must cut accepted draft tokens after the EOS.
    lm, tokenizer = loaded
    prompt = random_prompt(6)
    reference = exact_greedy(lm, prompt, MAX_NEW_TOKENS)
    first: dict[int, int] = {}
    for i, token in enumerate(reference):
        first.setdefault(token, i)
    candidates = [(pos, tok) for tok, pos in first.items()
                  if pos > NUM_DRAFT_TOKENS + 1 and pos % (NUM_DRAFT_TOKENS + 1) != NUM_DRAFT_TOKENS]
    assert len(candidates) >= 2, "the prompt's continuation must offer tokens to declare as EOS"
    for pos, eos in (candidates[0], candidates[-1]):
        expected = reference[:pos + 1]
        decoder = make_decoder(method, lm, tokenizer, other_draft)
        assert decoder.generate(prompt, greedy(MAX_NEW_TOKENS, frozenset({eos}))) == expected
        assert decoder.stats.num_new_tokens == len(expected)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("max_new_tokens", [1, 3, 7, 11])
def test_max_new_tokens_inside_draft(loaded, other_draft, method, max_new_tokens):
    # 5-token drafts: 3 ends inside round one's draft, 7 one token into round two, 11 inside round two's draft,
    # 1 leaves no room to draft at all.
    lm, tokenizer = loaded
    prompt = random_prompt(3)
    decoder = make_decoder(method, lm, tokenizer, other_draft, num_draft_tokens=5)
    out = decoder.generate(prompt, greedy(max_new_tokens))
    assert out == exact_greedy(lm, prompt, max_new_tokens)
    assert len(out) == max_new_tokens


def test_tree_method_is_refused_before_it_starts(loaded):
    # It used to build and then fail at its first branching draft, mid-answer (the adapter's own refusal, which
    # test_trees_hidden_states_and_scattered_keeps_are_refused holds).
    lm, tokenizer = loaded
    config = MethodConfig(name="specinfer", draft="fork", tree=(2, 2))
    with pytest.raises(UnsupportedOptionError, match="'specinfer' drafts token trees.*scores chains only"):
        build_method(MethodContext(config, lm, tokenizer, lambda source: (lm.fork("tiny-fork"), tokenizer)))


# --- vocabulary check and install hint -----------------------------------------------------------------------------

def test_vocabulary_mismatch_is_refused(tmp_path, loaded):
    tokenizer = loaded[1]
    tokens, types = tiny_vocab()
    swapped = list(tokens)
    swapped[100], swapped[101] = swapped[101], swapped[100]
    model = tiny_model(0, len(tokens))
    weights = LlamaCppWeights(write_gguf(tmp_path / "swapped.gguf", model, swapped, types))
    with pytest.raises(ModelLoadError, match=r"vocabulary mismatch .*\(id 100: llama.cpp"):
        check_vocabulary(weights, tokenizer)
    bigger = tiny_model(0, len(tokens) + 1)
    weights = LlamaCppWeights(write_gguf(tmp_path / "bigger.gguf", bigger, tokens + ["<|extra|>"], types + [3]))
    with pytest.raises(ModelLoadError, match="llama.cpp reads 264 tokens .* the tokenizer has 263"):
        check_vocabulary(weights, tokenizer)


def test_missing_llama_cpp_names_the_extra(monkeypatch, tiny, loaded):
    from jointspec.bench.engines import LlamaCppBackend, LlamaCppEngine

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(ModelLoadError, match=r"pip install 'jointspec\[llamacpp\]'"):
        load_llamacpp("default")
    # The bench: a baseline engine and a backend=llamacpp method fail the same way, before anything is timed.
    backend = LlamaCppBackend(str(tiny[0]), loaded[1], threads=1)
    with pytest.raises(ModelLoadError, match=r"pip install 'jointspec\[llamacpp\]'"):
        LlamaCppEngine(parse_spec("llamacpp-pld"), backend, frozenset())
    with pytest.raises(ModelLoadError, match=r"pip install 'jointspec\[llamacpp\]'"):
        backend.adapter()


def test_non_gguf_sources_are_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="loads GGUF files"):
        load_llamacpp(str(tmp_path))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_llamacpp(str(tmp_path / "missing.gguf"))


def test_default_gguf_path_keeps_one_checked_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("JOINTSPEC_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "fetched.gguf"
    source.write_bytes(b"GGUF and some bytes")
    digest = embedded._sha256(source)
    monkeypatch.setattr(embedded, "_fetch_gguf", lambda workdir: source)
    monkeypatch.setattr(embedded, "GGUF_SHA256", "0" * 64)
    monkeypatch.setattr(embedded, "GGUF_SIZE", len(b"GGUF and some bytes"))
    with pytest.raises(ModelLoadError, match="checksum mismatch"):
        embedded.default_gguf_path()
    assert not embedded.default_gguf_file().exists()
    assert [p.name for p in embedded.default_gguf_file().parent.iterdir()] == []  # no temporary left behind
    monkeypatch.setattr(embedded, "GGUF_SHA256", digest)
    path = embedded.default_gguf_path()
    assert path == embedded.default_gguf_file() and path.read_bytes() == source.read_bytes()

    def no_fetch(workdir):
        raise AssertionError("the kept copy must be used")

    monkeypatch.setattr(embedded, "_fetch_gguf", no_fetch)
    assert embedded.default_gguf_path() == path


# --- bench ---------------------------------------------------------------------------------------------------------

def test_bench_specs():
    assert parse_spec("pld:backend=llamacpp").backend == "llamacpp"
    assert parse_spec("pld").backend == "torch" and not parse_spec("pld").needs_llamacpp
    assert parse_spec("llamacpp-pld:num_pred_tokens=4").is_llamacpp_reference
    from jointspec.bench.specs import llamacpp_options

    assert llamacpp_options(parse_spec("llamacpp-pld:num_pred_tokens=4,flash_attn=true")) == {
        "num_pred_tokens": 4, "flash_attn": True}
    with pytest.raises(MethodSpecError, match="must be true/false"):
        llamacpp_options(parse_spec("llamacpp:flash_attn=maybe"))
    with pytest.raises(MethodSpecError, match="backend 'cuda' .* must be one of: torch, llamacpp"):
        parse_spec("ar:backend=cuda")
    with pytest.raises(MethodSpecError, match="unknown option 'backend' for method 'llamacpp'"):
        parse_spec("llamacpp:backend=llamacpp")
    with pytest.raises(MethodSpecError, match="must be >= 1"):
        from jointspec.bench.specs import method_config

        method_config(parse_spec("llamacpp-pld:num_pred_tokens=0"), MethodConfig())


def test_bench_runs_llamacpp_engines_side_by_side(tiny, loaded):
    # The torch target and the llama.cpp methods in one run, on the same prompt ids. Against the baseline
    # ar:backend=llamacpp, llama.cpp's own loop (plain, and with its prompt-lookup draft) and jointspec's methods on
    # the adapter must give identical tokens. Torch's ar runs beside them, compared with nothing (fp16 KV noise).
    # Rows with and without flash attention are compared here: on these prompts' greedy paths the smallest top-two
    # margin is 4.0e-3 and the two kernels' logits differ by at most 1.0e-3 (measured with this llama.cpp build), so
    # they agree; a build whose kernels differ four times more could part them at a near-tie.
    gguf_path, model = tiny
    tokenizer = loaded[1]
    prompts = [BenchPrompt("0", "x", ("the thin thing in the thin thin thing",)),
               BenchPrompt("1", "y", ("he in the the he he tin", "tin in the"))]
    baseline = "ar:backend=llamacpp"
    specs = parse_specs(f"ar,llamacpp,llamacpp-pld:num_pred_tokens=4,{baseline},pld:backend=llamacpp,"
                        "sps:backend=llamacpp,draft=self")
    config = BenchConfig(max_new_tokens=24, llamacpp_model=str(gguf_path), threads=1, cost_model=False,
                         perplexity=False)
    result = run_bench(CausalLM(model, name="tiny-torch"), tokenizer, prompts, specs, baseline, config,
                       progress=False)
    by_method: dict[str, list] = {}
    for run in result.runs:
        by_method.setdefault(run.method, []).append(run)
    assert set(by_method) == {s.label for s in specs}
    for label, runs in by_method.items():
        assert all(run.num_new_tokens == 24 * len(run.output_ids) for run in runs), label
        if label != "ar":
            assert all(run.identical for run in runs), label
    # Plain llama.cpp: one prefill and one call per new token but the last (never fed back), per turn.
    assert sum(r.num_target_calls for r in by_method["llamacpp"]) == 3 * 24
    # Its time to the first token stands for reading the prompt, as the loop's prefill does for jointspec's rows.
    assert all(0 < p < s for label in ("llamacpp", baseline) for r in by_method[label]
               for p, s in zip(r.prefill_seconds, r.seconds))
    assert sum(r.num_target_calls for r in by_method["llamacpp-pld:num_pred_tokens=4"]) < 3 * 24
    assert result.environment["llamacpp_threads"] == 1
    assert result.environment["llamacpp_model"] == str(gguf_path)


def test_bench_llamacpp_stops_on_eos(tiny, loaded):
    from jointspec.bench.engines import LlamaCppBackend, LlamaCppEngine

    tokenizer = loaded[1]
    backend = LlamaCppBackend(str(tiny[0]), tokenizer, threads=1)
    prompt = random_prompt(6)
    reference = plain(backend.adapter(), tokenizer, prompt, 30)
    eos = reference[9]
    expected = reference[:reference.index(eos) + 1]
    for spec in ("llamacpp", "llamacpp-pld"):
        engine = LlamaCppEngine(parse_spec(spec), backend, frozenset({eos}))
        out = engine.generate(prompt, 30, SamplingConfig(temperature=0.0), seed=0)
        assert out.new_ids == expected, spec
    with pytest.raises(MethodSpecError, match="greedy only"):
        engine.generate(prompt, 4, SamplingConfig(temperature=1.0), seed=0)


def test_bench_llamacpp_refuses_a_prompt_its_context_cannot_hold(tiny, loaded):
    """A prompt that fills llama.cpp's context would give no tokens in no time: refused, naming both sizes."""
    from jointspec.bench.engines import LlamaCppBackend, LlamaCppEngine

    backend = LlamaCppBackend(str(tiny[0]), loaded[1], threads=1, n_ctx=32)
    engine = LlamaCppEngine(parse_spec("llamacpp"), backend, frozenset())
    size = engine.llama.n_ctx()  # llama.cpp rounds a context up to a whole number of its blocks
    with pytest.raises(MethodSpecError, match=f"{size + 4} tokens leaves no room in llama.cpp's context of {size}"):
        engine.generate(random_prompt(7, length=size + 4), 4, SamplingConfig(temperature=0.0), seed=0)


@pytest.mark.parametrize("flags, expected", [({"avx2", "avx512f", "amx_tile", "amx_int8"}, False), ({"avx2"}, True)])
def test_extra_buffer_types_are_off_on_amx_cpus(tiny, loaded, monkeypatch, flags, expected):
    # llama.cpp's AMX kernels segfault on quantised batches (jointspec.backends.llamacpp): on a CPU with AMX, the
    # adapter's weights and the Llama class behind the bench's baselines must both load without them; elsewhere
    # both keep llama.cpp's default, and the Llama class's defaults are left as they were.
    from jointspec.bench.engines import LlamaCppBackend
    from jointspec.kernels import cpu as cpukernels

    monkeypatch.setattr(cpukernels, "cpu_flags", lambda: frozenset(flags))
    assert LlamaCppWeights(tiny[0]).extra_buffer_types is expected
    backend = LlamaCppBackend(str(tiny[0]), loaded[1], threads=1)
    assert backend.llama(logits_all=False).model_params.use_extra_bufts is expected
    assert backend.environment()["llamacpp_extra_buffer_types"] is expected
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts is True


def test_bench_refuses_a_gguf_of_another_vocabulary(tiny, tmp_path):
    from jointspec.bench.engines import LlamaCppBackend

    tokens, types = tiny_vocab()
    other_tokens = list(tokens)
    other_tokens[200] = "zz"
    path = write_gguf(tmp_path / "other.gguf", tiny_model(0, len(tokens)), other_tokens, types)
    bench_tokenizer = AutoTokenizer.from_pretrained(str(tiny[0].parent), gguf_file=tiny[0].name)
    with pytest.raises(ModelLoadError, match="does not use the bench target's tokenizer"):
        LlamaCppBackend(str(path), bench_tokenizer, threads=1).adapter()


def test_the_llamacpp_adapter_implements_the_target_protocol(lm):
    from jointspec.core.target import TargetCapabilities, TargetLM

    assert isinstance(lm, TargetLM)
    # chains only, no hidden states
    assert lm.capabilities == TargetCapabilities(fork=True, plain_decode=True, chains_only="llama.cpp's backend")
