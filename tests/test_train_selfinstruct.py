"""Self-instruct training prompts, warm-starting a head from another, and the data-only stage of train-draft.

Everything is seeded and runs on one thread, so no test here has false-failure odds: a failure is a behaviour change.
"""

from __future__ import annotations

import json

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.batch import engine as batch_module
from jointspec.core.errors import ModelLoadError, UnsupportedOptionError
from jointspec.drafts.artifact import HeadConfig
from jointspec.drafts.eagle import EagleHead, load_head
from jointspec.train import heads as heads_module
from jointspec.train import sources
from jointspec.train.data import build_data
from jointspec.train.heads import HeadTrainConfig, HeadTrainer
from jointspec.train.selfinstruct import SelfInstructConfig, self_instruct_prompts, user_turn_prefix

from helpers import random_prompt, tiny_llama, tiny_tokenizer

EOS = frozenset({2})


def test_user_turn_prefix_is_the_template_up_to_the_users_text():
    tokenizer = tiny_tokenizer()
    prefix = user_turn_prefix(tokenizer)
    assert tokenizer.decode(prefix) == "user :"  # the tiny template renders "user : {content} "
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        user_turn_prefix(tokenizer)


def test_requests_are_filtered_deduplicated_and_capped(target_model, monkeypatch):
    """Unfinished (no end-of-turn token), too short and repeated requests are dropped; draws are capped."""
    tokenizer = tiny_tokenizer()
    words = {w: tokenizer.convert_tokens_to_ids(w) for w in tokenizer.get_vocab()}
    long_request = [words["water"], words["wings"], words["warm"], words["write"]]
    outputs = iter([
        long_request + [2],                 # kept
        long_request,                       # cut by the length limit: dropped
        [words["why"], 2],                  # shorter than min_prompt_chars: dropped
        long_request + [2],                 # the same request again: dropped
        [words["what"]] + long_request + [2],  # kept
    ] + [long_request + [2]] * 100)         # from here on only repeats: the draw cap must end the loop
    seen_prompts = []

    def fake_generate(self, requests):
        requests = list(requests)
        seen_prompts.extend(r.prompt_ids for r in requests)
        return [next(outputs) for _ in requests]

    monkeypatch.setattr(batch_module.BatchEngine, "generate", fake_generate)
    target = CausalLM(target_model, name="tiny-target")
    config = SelfInstructConfig(num_prompts=3, batch_size=1, min_prompt_chars=8)
    found = self_instruct_prompts(target, tokenizer, config, EOS, progress=False)
    assert found == ["water wings warm write", "what water wings warm write"]
    assert len(seen_prompts) == 4 * config.num_prompts  # the cap on draws
    assert set(seen_prompts) == {tuple(user_turn_prefix(tokenizer))}
    with pytest.raises(ValueError, match="end-of-turn"):
        self_instruct_prompts(target, tokenizer, config, frozenset(), progress=False)


def test_self_instruct_on_a_tiny_model_is_deterministic_in_the_seed(target_model):
    tokenizer = tiny_tokenizer()
    target = CausalLM(target_model, name="tiny-target")
    config = SelfInstructConfig(num_prompts=5, max_prompt_tokens=64, batch_size=4, min_prompt_chars=1)
    first = self_instruct_prompts(target, tokenizer, config, EOS, progress=False)
    again = self_instruct_prompts(target, tokenizer, config, EOS, progress=False)
    other = self_instruct_prompts(target, tokenizer, SelfInstructConfig(**{**config.__dict__, "seed": 1}), EOS,
                                  progress=False)
    assert len(first) == 5 and len(set(first)) == 5
    assert first == again
    # Seeds 0 and 1 differ in every prompt; for another pair of seeds, drawing the same five prompts (of 1 to ~60
    # words each) would be a coincidence of odds far below 1e-6.
    assert first != other


@pytest.fixture(scope="module")
def head_data(tmp_path_factory, target_model):
    target = CausalLM(target_model, name="tiny-target")
    data = tmp_path_factory.mktemp("data")
    prompts = [random_prompt(300 + i, length=8) for i in range(32)]
    build_data(target, None, prompts, data, max_new_tokens=32, max_length=128, shard_size=16, batch_size=8)
    return data


def _config(**overrides) -> HeadTrainConfig:
    settings = dict(draft_vocab_size=60, epochs=6, batch_tokens=512, learning_rate=3e-3, warmup_steps=5,
                    eval_every=10, patience=100, eval_fraction=0.15)
    return HeadTrainConfig(**{**settings, **overrides})


def test_warm_start_keeps_the_vocabulary_and_never_saves_a_worse_head(target_model, head_data, tmp_path,
                                                                       monkeypatch):
    target = CausalLM(target_model, name="tiny-target")
    first, first_result = HeadTrainer(target, _config(epochs=3)).train(head_data, tmp_path / "a", progress=False)
    # Warm start at a learning rate so high that training can only hurt: the start is evaluated first, so the
    # saved head is the starting one unless a later evaluation beats it.
    init, _ = load_head(tmp_path / "a")
    (head_data / heads_module.ARGMAX_FILE).unlink()  # as for data no from-scratch run has used yet
    scored = []
    real_argmax = heads_module._target_argmax
    monkeypatch.setattr(heads_module, "_target_argmax", lambda features, *a: scored.append(1) or real_argmax(
        features, *a))
    _, result = HeadTrainer(target, _config(learning_rate=5.0, epochs=2, draft_vocab_size=20)).train(
        head_data, tmp_path / "b", progress=False, init=init)
    # A warm start scores only the held-out sequences with the target's argmax (the training losses do not read it).
    tokens = [ids for ids, _, _ in heads_module._sequences([head_data])]
    assert len(scored) == len(heads_module.held_out_split(tokens, _config().eval_fraction)[0]) < len(tokens) / 2
    assert result.history[0].step == 0
    saved, training = load_head(tmp_path / "b")
    assert torch.equal(saved.draft_vocab, init.draft_vocab)  # the init head's vocabulary, not a new one of 20
    assert result.best.agreement[0] >= result.history[0].agreement[0]
    assert training["best"]["agreement"] == result.best.agreement
    if result.best.step == 0:  # nothing beat the start: the saved weights are the starting ones
        assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), init.state_dict().values()))
    # The start's held-out agreement equals the first head's best on the same split (same seed, same data).
    assert result.history[0].agreement == first_result.best.agreement
    with pytest.raises(UnsupportedOptionError, match="--layers 1"):
        HeadTrainer(target, _config(num_layers=2)).train(head_data, tmp_path / "c", progress=False, init=init)


def test_training_losses_do_not_read_label_values(target_model, head_data):
    """Training batches carry placeholder labels (0 on every real position, see _collate): the loss and its
    gradients must equal those with the target's true argmax labels, bit for bit."""
    target = CausalLM(target_model, name="tiny-target")
    trainer = HeadTrainer(target, _config())
    sequences = heads_module._sequences([head_data])[:6]
    true_labels = [heads_module._target_argmax(feats, trainer.lm_weight_full) for _, feats, _ in sequences]
    vocab = torch.arange(60)
    draft_index = torch.full((target.vocab_size,), -1, dtype=torch.long)
    draft_index[vocab] = torch.arange(60)
    results = []
    for labels_of in (true_labels, None):
        torch.manual_seed(0)
        head = EagleHead(HeadConfig.for_target(target, "x", num_layers=1, draft_vocab_size=60))
        tokens, features, labels = heads_module._collate(sequences, list(range(6)), labels_of, "cpu")
        generator = torch.Generator().manual_seed(3)
        outputs = trainer._passes(head, tokens, features, generator, 0.05)
        loss, _, _ = trainer._loss(outputs, features, labels, trainer.lm_weight_full[vocab], draft_index, generator,
                                   0.25)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in head.parameters() if p.grad is not None]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and len(grads_a) == len(grads_b) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def _patch_cli(monkeypatch, target_model):
    from jointspec.cli import train as train_cli

    monkeypatch.setattr(train_cli, "load_target",
                        lambda *args, **kwargs: (CausalLM(target_model, name="tiny-target"), tiny_tokenizer()))


def test_train_draft_self_instruct_data_only_then_init(target_model, tmp_path, monkeypatch, capsys):
    """self-instruct prompts are cached in the data folder; --data-only stops before training; --init resumes from a
    head and refuses one made for another target."""
    from jointspec.cli import main as cli

    _patch_cli(monkeypatch, target_model)
    data = tmp_path / "data"
    common = ["train-draft", "--data", str(data), "--prompts", "self-instruct:6", "--max-new-tokens", "16",
              "--generate-batch-size", "4", "--no-progress"]
    assert cli.main(common + ["--out", str(tmp_path / "unused"), "--data-only"]) == 0
    out, err = capsys.readouterr()
    assert "self-instruct prompts" not in err  # its bar too keeps quiet under --no-progress
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["data_spec"]["num_prompts"] == 6
    assert not (tmp_path / "unused" / "draft.json").exists()
    cached = json.loads((data / "self-instruct-6-seed0.json").read_text())
    assert len(cached["prompts"]) == 6
    stamp = (data / "self-instruct-6-seed0.json").stat().st_mtime_ns
    train = ["--epochs", "2", "--eval-every", "5", "--batch-tokens", "256", "--draft-vocab", "40"]
    assert cli.main(common + ["--out", str(tmp_path / "a")] + train) == 0
    assert (data / "self-instruct-6-seed0.json").stat().st_mtime_ns == stamp  # the prompts were reused
    other_vocab = [word if word != "40" else "30" for word in train]
    assert cli.main(common + ["--out", str(tmp_path / "b"), "--init", str(tmp_path / "a")] + other_vocab) == 0
    _, training = load_head(tmp_path / "b")
    assert training["settings"]["draft_vocab_size"] == 40  # the head it started from, not the unused --draft-vocab
    assert training["init"]["folder"] == str(tmp_path / "a") and "--init" in training["command"]
    assert training["init"]["best"] == load_head(tmp_path / "a")[1]["best"]
    assert "--draft-vocab" not in training["command"]  # not used by a warm start, so not recorded as if it were
    capsys.readouterr()

    # A head for another target, and a folder that is no head, are refused before any work.
    monkeypatch.setattr("jointspec.cli.train.load_target",
                        lambda *args, **kwargs: (CausalLM(tiny_llama(7), name="other"), tiny_tokenizer()))
    assert cli.main(common + ["--out", str(tmp_path / "c"), "--init", str(tmp_path / "a")] + train) == 2
    assert "was trained for target 'tiny-target'" in capsys.readouterr().err
    assert cli.main(common + ["--out", str(tmp_path / "c"), "--init", str(tmp_path)] + train) == 2
    assert "not a draft folder" in capsys.readouterr().err
    assert cli.main(["train-draft", "--out", str(tmp_path / "d"), "--prompts", "self-instruct:x"]) == 2
    assert "self-instruct:N" in capsys.readouterr().err


def test_model_load_error_is_what_a_wrong_target_raises(target_model, tmp_path, head_data):
    """check_head_target is the one place that refuses a head for another target (bind_head and --init use it)."""
    from jointspec.drafts.artifact import check_head_target

    target = CausalLM(target_model, name="tiny-target")
    HeadTrainer(target, _config(epochs=1)).train(head_data, tmp_path / "h", progress=False)
    head, _ = load_head(tmp_path / "h")
    check_head_target(head, tmp_path / "h", target)
    with pytest.raises(ModelLoadError, match="fingerprint"):
        check_head_target(head, tmp_path / "h", CausalLM(tiny_llama(7), name="other"))


def test_builtin_training_prompt_sources_split_the_default_mix():
    """train:default is train:chat and train:code interleaved; unknown sources name the ones that exist."""
    from jointspec.train.prompts import chat_prompts, default_training_prompts, stdlib_code_prompts

    tokenizer = tiny_tokenizer()
    chat, code = chat_prompts(600), stdlib_code_prompts(300)
    assert len(chat) == 600 and len(code) == 300 and all(text.startswith("Complete this Python") for text in code)
    assert sorted(default_training_prompts()) == sorted(chat + code)
    both, answers = sources.training_prompts(["train:chat", "train:code"], tokenizer)
    assert len(both) == 900
    assert both[600:] == sources.training_prompts(["train:code"], tokenizer)[0]
    assert answers == [None] * len(both)  # the target answers these itself
    with pytest.raises(UnsupportedOptionError, match="train:code"):
        sources.training_prompts(["train:nothing"], tokenizer)


def test_a_training_jsonl_takes_prompt_or_turns_rows_and_names_a_bad_line(tmp_path):
    """``--prompts FILE.jsonl``: rows with ``prompt`` or ``turns`` (the bench's own files work as they are)."""

    good = tmp_path / "requests.jsonl"
    good.write_text('{"prompt": "name three birds"}\n\n'
                    '{"question_id": 7, "category": "x", "turns": ["sum two numbers", "now three"]}\n')
    assert sources.jsonl_prompts(good) == ["name three birds", "sum two numbers"]
    prompts, answers = sources.training_prompts([str(good)], tiny_tokenizer())
    assert len(prompts) == 2 and answers == [None, None]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n')
    with pytest.raises(UnsupportedOptionError, match=r"bad\.jsonl:2: expected an object with 'prompt'"):
        sources.jsonl_prompts(bad)
    bad.write_text('{"prompt": "fine"\n')
    with pytest.raises(UnsupportedOptionError, match=r"bad\.jsonl:1: not valid JSON"):
        sources.jsonl_prompts(bad)
    with pytest.raises(UnsupportedOptionError, match="cannot read prompt file"):
        sources.jsonl_prompts(tmp_path / "missing.jsonl")
