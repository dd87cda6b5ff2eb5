"""The Python API's Pipeline: one request at a time whatever its callers do (threads, interleaved streams), and clear
errors for the arguments a caller can get wrong (a method name, prompt ids as a tensor or out of the vocabulary,
seeds and counts of the wrong type).

Tiny in-process Llama, greedy decoding and seeded sampled runs: deterministic, no false-failure odds (the one
unseeded run is checked only for what holds whatever it samples).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from jointspec.api import GenerationConfig, Pipeline
from jointspec.backends.hf import CausalLM
from jointspec.core.errors import JointspecError

from helpers import VOCAB, random_prompt

CONFIG = GenerationConfig(max_new_tokens=16)


def pipeline(model, method: str = "pld") -> Pipeline:
    return Pipeline(CausalLM(model, name="tiny"), None, method)  # the name alone, as the CLI's --method


def test_threads_calling_generate_on_one_pipeline_each_get_their_own_answer(target_model):
    prompts = [random_prompt(seed) for seed in range(4)]
    alone = [pipeline(target_model).generate_ids(p, CONFIG).token_ids for p in prompts]
    shared = pipeline(target_model)
    assert in_threads(lambda i: shared.generate_ids(prompts[i], CONFIG).token_ids, len(prompts)) == alone


def in_threads(work, count: int) -> list:
    """``work(i)`` for i in 0..count-1, each on a thread of its own, all started together; the results in order."""
    results = {}

    def run(index):
        results[index] = work(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[i] for i in range(count)]


def test_a_stream_left_open_is_ended_by_the_next_generation_and_says_so(target_model):
    shared = pipeline(target_model)
    first, second = random_prompt(1), random_prompt(2)
    expected = pipeline(target_model).generate_ids(second, CONFIG).token_ids
    open_stream = shared.stream_ids(first, CONFIG)
    next(open_stream)
    assert shared.generate_ids(second, CONFIG).token_ids == expected  # the open stream did not disturb it
    with pytest.raises(JointspecError, match="another generation started"):
        next(open_stream)
    one, two = shared.stream_ids(first, CONFIG), shared.stream_ids(second, CONFIG)
    next(one)
    next(two)  # starting the second ends the first
    with pytest.raises(JointspecError, match="another generation started"):
        next(one)


def test_a_stream_started_in_another_thread_waits_for_a_running_generate(target_model):
    """generate() owns the decoder until it returns: a stream another thread starts meanwhile waits for it (it does
    not end the running call, as it ends a stream left open), then decodes its own answer. The first generation is
    held after its first round until the other thread is inside stream_ids, so the two overlap every run."""
    first, second = random_prompt(1), random_prompt(2)
    expected = [pipeline(target_model).generate_ids(prompt, CONFIG).token_ids for prompt in (first, second)]
    shared = pipeline(target_model)
    decoder_stream, calls = shared.decoder.stream, []
    held, streaming = threading.Event(), threading.Event()

    def held_after_a_round(*args, **kwargs):
        rounds = decoder_stream(*args, **kwargs)
        calls.append(args)
        chunk = next(rounds)
        if len(calls) == 1:  # the generate() call
            held.set()
            assert streaming.wait(10)
            time.sleep(0.2)  # the other thread is now waiting (or, without the fix, ending this generation)
        yield chunk
        yield from rounds

    shared.decoder.stream = held_after_a_round
    results = {}

    def stream_in_another_thread():
        streaming.set()
        results["stream"] = [token for chunk in shared.stream_ids(second, CONFIG) for token in chunk]

    generating = threading.Thread(target=lambda: results.update(generate=shared.generate_ids(first, CONFIG)))
    generating.start()
    assert held.wait(10)
    other = threading.Thread(target=stream_in_another_thread)
    other.start()
    generating.join(30)
    other.join(30)
    assert results["generate"].token_ids == expected[0]
    assert results["stream"] == expected[1]


def test_a_setting_the_method_does_not_read_is_refused(target_model):
    from jointspec.core.errors import UnsupportedOptionError
    from jointspec.methods import MethodConfig

    with pytest.raises(UnsupportedOptionError, match="method 'pld' does not read beam_width"):
        Pipeline(CausalLM(target_model), None, MethodConfig(name="pld", beam_width=8))
    Pipeline(CausalLM(target_model), None, MethodConfig(name="pld", max_ngram=4))  # one it reads


def test_prompt_ids_as_tensors_and_bad_ids_are_handled_by_name(target_model):
    shared = pipeline(target_model, "ar")
    prompt = random_prompt(3)
    expected = shared.generate_ids(prompt, CONFIG).token_ids
    assert shared.generate_ids(torch.tensor(prompt), CONFIG).token_ids == expected
    with pytest.raises(JointspecError, match=f"token id {VOCAB} at position 1 is outside the vocabulary"):
        shared.generate_ids([1, VOCAB], CONFIG)
    with pytest.raises(JointspecError, match="token id -5"):
        shared.generate_ids([1, -5], CONFIG)
    with pytest.raises(TypeError, match="item 0"):
        shared.generate_ids([[1, 2, 3]], CONFIG)
    with pytest.raises(TypeError, match="for text, call generate"):
        shared.generate_ids("hello", CONFIG)
    with pytest.raises(TypeError, match="MethodConfig or a method name"):
        Pipeline(CausalLM(target_model), None, 3)


def test_generation_config_checks_types_and_takes_none_for_a_fresh_seed(target_model):
    for bad in (dict(max_new_tokens=2.5), dict(top_k=2.5), dict(seed="1")):
        with pytest.raises(TypeError, match=next(iter(bad))):
            GenerationConfig(**bad)
    with pytest.raises(ValueError, match="seed"):
        GenerationConfig(seed=2 ** 70)
    sampled = GenerationConfig(max_new_tokens=8, temperature=1.0, seed=None)
    fresh = pipeline(target_model, "ar")
    ids = fresh.generate_ids(random_prompt(4), sampled).token_ids
    # A fresh seed may sample the end of sequence before the eighth token: then it ends there, nowhere else.
    assert 1 <= len(ids) <= 8 and (len(ids) == 8 or ids[-1] in fresh.eos_token_ids), ids
    assert not set(ids[:-1]) & set(fresh.eos_token_ids)
    seeded = GenerationConfig(max_new_tokens=8, temperature=1.0, seed=7)
    shared = pipeline(target_model, "ar")
    assert shared.generate_ids(random_prompt(4), seeded).token_ids == shared.generate_ids(random_prompt(4),
                                                                                           seeded).token_ids


def test_streamed_text_adds_up_to_the_generated_text(byte_model, tokenizer):
    """A text ending in half a UTF-8 character (the byte tokenizer cuts anywhere) kept its U+FFFD in ``text`` and lost
    it from the stream; both now end alike. Seeded sampled runs of several lengths: deterministic."""
    pipe = Pipeline(CausalLM(byte_model, name="tiny"), tokenizer, "pld")
    cut = 0
    for seed in range(12):
        for length in (3, 5, 8):
            config = GenerationConfig(max_new_tokens=length, temperature=1.0, seed=seed)
            result = pipe.generate("héllo wörld ☃", config)
            pieces: list[str] = []
            again = pipe.generate("héllo wörld ☃", config, on_text=pieces.append)
            assert "".join(pieces) == again.text == result.text
            assert "".join(pipe.stream("héllo wörld ☃", config)) == result.text
            cut += result.text.endswith("\ufffd")
    assert cut > 0  # the case the test is about occurred (a run gave 18 of 36)


def test_a_tokenizer_that_cleans_up_spaces_streams_each_piece_once():
    """A tokenizer with clean_up_tokenization_spaces rewrites " '" followed by "m" as "'m": decoded with clean-up, a
    stream had to send the whole text again. Text is decoded without it, by the stream and by generate alike."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jointspec.backends.tokens import IncrementalDetokenizer, decode_text

    vocab = {"I": 0, "Ġ'": 1, "m": 2, "Ġok": 3}
    model = Tokenizer(models.WordLevel(vocab=vocab, unk_token="I"))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    tokens = PreTrainedTokenizerFast(tokenizer_object=model, clean_up_tokenization_spaces=True)
    ids = [0, 1, 2, 3, 0, 1, 2, 3]
    assert tokens.decode(ids) != decode_text(tokens, ids)  # the clean-up this is about
    detok = IncrementalDetokenizer(tokens)
    streamed = "".join(detok.push([token]) for token in ids) + detok.finish()
    assert streamed == decode_text(tokens, ids) == "I 'm okI 'm ok"


def test_a_dropped_stream_finalised_inside_a_round_does_not_deadlock(target_model):
    """A stream dropped in a reference cycle is finalised by the cyclic collector wherever it runs, also inside a
    round of another generation on the same thread, where the Pipeline's lock is held. The round here runs the
    collector at once; with a plain lock the generation never returned."""
    import gc

    pipe = pipeline(target_model)
    finish_round = pipe.decoder.finish_round

    def finish_round_collecting(state, output):
        gc.collect()
        return finish_round(state, output)

    class Holder:
        pass

    holder = Holder()
    holder.me = holder
    holder.stream = pipe.stream_ids(random_prompt(0), CONFIG)
    next(holder.stream)
    del holder  # only the cyclic collector can finalise it now
    pipe.decoder.finish_round = finish_round_collecting
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=pipe.generate_ids(random_prompt(1), CONFIG)),
                              daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "generate_ids deadlocked"
    assert result["r"].token_ids == pipeline(target_model).generate_ids(random_prompt(1), CONFIG).token_ids


@pytest.mark.parametrize("temperature,error", [(1e-40, ValueError), (float("inf"), ValueError), (True, TypeError),
                                               ("0.5", TypeError)])
def test_temperatures_that_cannot_sample_are_refused_by_name(temperature, error):
    with pytest.raises(error, match="temperature"):
        GenerationConfig(temperature=temperature)


def test_pipelines_on_one_target_share_its_cache_one_generation_at_a_time(target_model):
    """Two pipelines built on one loaded target read and write one cache: an open stream of one is ended by the
    other's generation, with the error that says so, not continued on the other's entries (it returned the wrong text
    before), and threads calling both get their own answers."""
    target = CausalLM(target_model, name="tiny")
    first, second = Pipeline(target, None, "ar"), Pipeline(target, None, "pld")
    prompts = [random_prompt(seed) for seed in range(4)]
    alone = [pipeline(target_model, "ar").generate_ids(p, CONFIG).token_ids for p in prompts]
    one = first.stream_ids(prompts[0], CONFIG)
    assert next(one) == alone[0][:1]
    assert second.generate_ids(prompts[1], CONFIG).token_ids == alone[1]
    with pytest.raises(JointspecError, match="another generation started"):
        next(one)
    pipes = (first, second)
    assert in_threads(lambda i: pipes[i % 2].generate_ids(prompts[i], CONFIG).token_ids, len(prompts)) == alone
    # A wrapper over the target (an approximate attention mode) reads and writes the same cache.
    from jointspec.drafters.approximate import with_attention

    wrapped = Pipeline(with_attention(target, "sparse"), None, "ar")
    one = first.stream_ids(prompts[0], CONFIG)
    next(one)
    wrapped.generate_ids(prompts[1], CONFIG)
    with pytest.raises(JointspecError, match="another generation started"):
        next(one)


def test_arguments_of_the_wrong_kind_are_refused_by_name(target_model, byte_model, tokenizer):
    texts = Pipeline(CausalLM(byte_model, name="tiny"), tokenizer, "ar")
    for prompt in ([1, 2, 3], None, [{"role": "user", "content": "hi"}]):
        with pytest.raises(TypeError, match="generate_ids"):
            texts.generate(prompt, CONFIG)
        with pytest.raises(TypeError, match="generate_ids"):
            list(texts.stream(prompt, CONFIG))
    for config in (None, {"max_new_tokens": 8}):
        with pytest.raises(TypeError, match="GenerationConfig"):
            texts.generate("hi", config)
        with pytest.raises(TypeError, match="GenerationConfig"):
            pipeline(target_model).generate_ids(random_prompt(1), config)
    with pytest.raises(TypeError, match="chat"):
        GenerationConfig(chat="no")


def test_a_fresh_seed_is_reported_and_repeats_its_answer(target_model):
    pipe = pipeline(target_model, "ar")
    fresh = pipe.generate_ids(random_prompt(4), GenerationConfig(max_new_tokens=8, temperature=1.0, seed=None))
    assert isinstance(fresh.seed, int)
    again = pipe.generate_ids(random_prompt(4), GenerationConfig(max_new_tokens=8, temperature=1.0, seed=fresh.seed))
    assert again.token_ids == fresh.token_ids and again.seed == fresh.seed


def test_logprobs_come_with_the_answer_when_asked_and_leave_it_unchanged(target_model):
    pipe = pipeline(target_model, "pld")
    prompt = random_prompt(5)
    config = GenerationConfig(max_new_tokens=12, temperature=0.9, top_k=20, seed=3)
    plain = pipe.generate_ids(prompt, config)
    scored = pipe.generate_ids(prompt, GenerationConfig(**{**config.__dict__, "logprobs": 2}))
    assert plain.logprobs is None and "logprobs" not in plain.to_dict()
    assert scored.token_ids == plain.token_ids and [f.token_id for f in scored.logprobs] == scored.token_ids
    with torch.no_grad():
        logits = target_model(torch.tensor([prompt + scored.token_ids[:-1]])).logits[0, len(prompt) - 1:]
    expected = torch.log_softmax(logits.double(), -1)
    assert [f.logprob for f in scored.logprobs] == pytest.approx(
        [float(expected[i, t]) for i, t in enumerate(scored.token_ids)], abs=1e-4)
    listed = scored.to_dict()["logprobs"]
    assert len(listed) == len(scored.token_ids) and all(len(entry["top"]) == 2 for entry in listed)
    with pytest.raises(ValueError, match="logprobs must be a whole number from 0 to 20"):
        GenerationConfig(logprobs=21)
    # Streamed: the same figures, a round's at a time.
    streamed = list(pipe.stream_logprobs(prompt, GenerationConfig(**{**config.__dict__, "logprobs": 2})))
    assert len(streamed) > 1 and [f for chunk in streamed for f in chunk] == scored.logprobs
    with pytest.raises(ValueError, match="stream_logprobs needs config.logprobs"):
        next(pipe.stream_logprobs(prompt, config))


@pytest.mark.parametrize("options, match", [(dict(model=""), "model must be"), (dict(model=123), "model must be"),
                                            (dict(threads="2"), "threads"), (dict(threads=1.5), "threads")])
def test_load_arguments_of_the_wrong_kind_are_refused_before_loading(options, match):
    from jointspec.core.errors import ModelLoadError, UnsupportedOptionError
    with pytest.raises((ModelLoadError, UnsupportedOptionError), match=match):
        Pipeline.load(**options)


@pytest.mark.parametrize("method, match", [("nope", "unknown method 'nope'"), (5, "method must be a MethodConfig"),
                                           ("ar:n=8", "unknown method"), (None, None)])
def test_load_checks_the_method_before_it_loads_the_model(method, match, monkeypatch):
    """A misspelt method, or an option it does not read, was refused only after the whole model had loaded."""
    from jointspec import api
    from jointspec.core.errors import UnsupportedOptionError
    from jointspec.methods import MethodConfig

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(api, "load_model", no_load)
    for bad in ([method] if method is not None else [MethodConfig(name="ar", num_draft_tokens=8)]):
        with pytest.raises((TypeError, UnsupportedOptionError), match=match or "does not read num_draft_tokens"):
            Pipeline.load(method=bad)


def test_a_pipeline_refuses_what_it_cannot_decode_with_by_name(target_model, byte_model, tokenizer):
    """A transformers model where a loaded target belongs, a memory that is no OutputMemory, text for a pipeline
    without a tokenizer, a callback that is not one and a tree given as a number each failed later, in another
    library's words (an AttributeError in the middle of a generation)."""
    from jointspec.core.errors import JointspecError
    from jointspec.core.grammar import GrammarError, OutputFormat
    from jointspec.methods import MethodConfig

    with pytest.raises(TypeError, match="target must be a loaded target .*CausalLM.* not LlamaForCausalLM"):
        Pipeline(byte_model, tokenizer, "pld")
    with pytest.raises(TypeError, match="memory must be an OutputMemory or None, not list"):
        Pipeline(CausalLM(byte_model), tokenizer, "pld", memory=[])
    with pytest.raises(JointspecError, match="no tokenizer.*generate_ids"):
        Pipeline(CausalLM(byte_model), None, "ar").generate("hi", CONFIG)
    with pytest.raises(TypeError, match="on_text must be a function"):
        Pipeline(CausalLM(byte_model), tokenizer, "ar").generate("hi", CONFIG, on_text=5)
    with pytest.raises(JointspecError, match="no tokenizer, so it cannot give on_text"):
        Pipeline(CausalLM(byte_model), None, "ar").generate_ids([5, 6, 7], CONFIG, on_text=print)
    with pytest.raises(TypeError, match="tree must be a list of ints"):
        MethodConfig(name="specinfer", tree=4)
    for spec, match in (("{bad", "not valid JSON"), ("[1]", "must be a JSON object")):
        with pytest.raises(GrammarError, match=match):
            OutputFormat("json", spec)


def test_numpy_scalars_are_taken_wherever_python_numbers_are(target_model):
    """numpy's ints and floats were refused by GenerationConfig and in a list of prompt ids (np.float64 alone passed,
    as a float subclass), though MethodConfig and an array of ids took them."""
    import numpy as np

    config = GenerationConfig(max_new_tokens=np.int64(6), temperature=np.float32(0.5), top_k=np.int32(4),
                              top_p=np.float32(0.9), seed=np.int64(3))
    assert (type(config.max_new_tokens), type(config.seed), type(config.sampling.temperature)) == (int, int, float)
    pipe = pipeline(target_model, "ar")
    prompt = random_prompt(2)
    as_numpy = pipe.generate_ids([np.int64(t) for t in prompt], config).token_ids
    assert as_numpy == pipe.generate_ids(prompt, GenerationConfig(max_new_tokens=6, temperature=0.5, top_k=4,
                                                                  top_p=float(np.float32(0.9)), seed=3)).token_ids
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        GenerationConfig(max_new_tokens=np.float64(6))


def test_chat_template_variables_reach_the_template_and_bad_ones_are_refused(byte_model):
    from jointspec.backends.tokens import chat_template_ids

    from helpers import byte_tokenizer

    words = byte_tokenizer()  # (a tokenizer of its own: the fixture's is shared)
    words.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
                           "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    pipe = Pipeline(CausalLM(byte_model, name="tiny"), words, "ar")
    off = GenerationConfig(max_new_tokens=3, chat_template_kwargs={"enable_thinking": False})
    assert pipe.generate("hi", off).prompt_ids == chat_template_ids(words, [{"role": "user", "content": "hi"}],
                                                                    template_kwargs={"enable_thinking": False})
    assert words.decode(pipe.generate("hi", off).prompt_ids).endswith("<assistant><think></think>")
    assert words.decode(pipe.generate("hi", GenerationConfig(max_new_tokens=3)).prompt_ids).endswith("<assistant>")
    with pytest.raises(ValueError, match="may not set tools"):
        GenerationConfig(chat_template_kwargs={"tools": []})
    with pytest.raises(TypeError, match="chat_template_kwargs must be a mapping"):
        GenerationConfig(chat_template_kwargs=[("a", 1)])


def test_load_sets_torchs_threads_before_the_model_loads_and_restores_them_where_it_fails(monkeypatch):
    """--quantize auto may time kernels while the model loads (kernels/probe.py), so the threads asked for are set
    first; a load that fails leaves the process's threads as they were."""
    import torch

    from jointspec import api

    before, seen = torch.get_num_threads(), []

    def failing_load(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise RuntimeError("no model here")

    monkeypatch.setattr(api, "load_model", failing_load)
    wanted = 1 if before != 1 else 2
    with pytest.raises(RuntimeError, match="no model here"):
        Pipeline.load(threads=wanted)
    assert seen == [wanted] and torch.get_num_threads() == before
