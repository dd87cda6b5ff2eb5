"""EAGLE heads that fuse several of the target's layers (``fuse_layers``, EAGLE-3 style): the mirror records the
right hidden states, a zero fusion drafts exactly as the head it starts from, training and reloading work, decoding
with a fused head stays lossless, and data without the layers is refused clearly.

Greedy equivalence is exact by construction (no false-failure odds); the training test is seeded and deterministic
on one thread, its margin (acceptance above 0.3) set from a run giving 0.46 (an unfused head on the same data: 0.47).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafts.eagle import EagleHead, HeadDraftModel, load_head
from jointspec.train.data import build_data
from jointspec.train.heads import HeadTrainConfig, HeadTrainer

from helpers import (
    assert_greedy_equivalent,
    assert_loads_to_the_same_decoding,
    fixed_length_decoder,
    random_prompt,
    sps_acceptance,
    tiny_training_data,
    train_cli_argv,
    untrained_head,
)

FUSE = (0, 1)  # the tiny target's embedding output and its first layer's output (it has 2 layers)


def fused_training_data(tmp_path_factory, target_model):
    """:func:`helpers.tiny_training_data`'s prompts and answers, with the hidden states at ``FUSE`` kept too."""
    target = CausalLM(target_model, name="tiny-target")
    prompts = [random_prompt(100 + i, length=8) for i in range(48)]
    data = tmp_path_factory.mktemp("fused-data")
    build_data(target, None, prompts, data, max_new_tokens=40, max_length=128, shard_size=16, batch_size=8,
               fuse_layers=FUSE)
    return data


def train_config(**changes) -> HeadTrainConfig:
    settings = dict(draft_vocab_size=None, epochs=40, batch_tokens=512, learning_rate=3e-3, warmup_steps=10,
                    eval_every=40, patience=100, eval_fraction=0.1, fuse_layers=FUSE)
    return HeadTrainConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def fused_data(tmp_path_factory, target_model):
    return fused_training_data(tmp_path_factory, target_model)


@pytest.fixture(scope="module")
def fused_head_dir(tmp_path_factory, target_model, fused_data):
    out = tmp_path_factory.mktemp("fused-head")
    HeadTrainer(CausalLM(target_model, name="tiny-target"), train_config()).train(fused_data, out, progress=False)
    return out


def test_mirror_records_the_requested_hidden_states(target_model):
    target = CausalLM(target_model)
    mirror = target.attach_feature_mirror((-1, *FUSE))
    target.reset()
    prompt = random_prompt(5, length=12)
    target.forward(prompt[:7])
    target.forward(prompt[7:], parents=None)
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=target_model.device)
        states = target_model(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([states[layer][0] for layer in (-1, *FUSE)], -1)
    assert mirror.features.shape == expected.shape
    torch.testing.assert_close(mirror.features, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(UnsupportedOptionError, match="2 decoder layers"):
        target.attach_feature_mirror((-1, 2))


def test_a_zero_fusion_drafts_exactly_as_the_head_it_starts_from(target_model):
    plain = untrained_head(CausalLM(target_model))
    fused = EagleHead(replace(plain.config, fuse_layers=FUSE)).eval()
    missing, unexpected = fused.load_state_dict(plain.state_dict(), strict=False)
    assert missing == ["fuse_fc.weight"] and not unexpected
    context = random_prompt(7, length=10)

    def draft_logits(head):
        target = CausalLM(target_model)
        draft = HeadDraftModel(head, target)
        target.reset()
        target.forward(context[:-1], num_logits=0)
        return draft.forward(context).logits

    torch.testing.assert_close(draft_logits(fused), draft_logits(plain), rtol=0, atol=1e-6)
    # The check can fail: a non-zero fusion changes the drafts.
    with torch.no_grad():
        fused.fuse_fc.weight.normal_(0, 0.5)
    assert not torch.allclose(draft_logits(fused), draft_logits(plain), atol=1e-3)


def test_fused_training_raises_acceptance_and_reloads(target_model, fused_head_dir):
    head, training = load_head(fused_head_dir)
    assert head.config.fuse_layers == FUSE and training["settings"]["fuse_layers"] == list(FUSE)
    assert head.fuse_fc.weight.abs().sum() > 0  # the fusion was trained, not left at its zero start
    assert sps_acceptance(target_model, fused_head_dir) > 0.3
    assert_loads_to_the_same_decoding(target_model, fused_head_dir, random_prompt(0))


@pytest.mark.parametrize("method,config", [("sps", {"num_draft_tokens": 4}),
                                           ("hybrid-tree", {"tree": (2, 2), "min_ngram": 2}),
                                           ("hybrid-tree", {"tree_budget": 4}),
                                           ("specinfer", {"tree": (3, 2, 1)}),
                                           ("mtad", {"num_draft_tokens": 4, "beam_width": 3})])
def test_greedy_equivalence_with_a_fused_head(target_model, fused_head_dir, method, config):
    assert_greedy_equivalent(target_model, fixed_length_decoder(target_model, method, fused_head_dir, **config),
                             random_prompt(3))


def test_a_warm_start_begins_where_the_unfused_head_stands(target_model, tmp_path_factory, fused_data, tmp_path):
    """Starting a fused head from an unfused one: the first (pre-training) evaluation is the unfused head's own."""
    target = CausalLM(target_model, name="tiny-target")
    plain_data = tiny_training_data(tmp_path_factory, target_model)  # the same sequences without the fused layers
    init, _ = HeadTrainer(target, train_config(fuse_layers=(), epochs=10)).train(plain_data, tmp_path / "init",
                                                                                 progress=False)
    short = dict(epochs=1, eval_every=1000)
    _, plain = HeadTrainer(target, train_config(fuse_layers=(), **short)).train(
        plain_data, tmp_path / "plain", progress=False, init=init)
    _, fused = HeadTrainer(target, train_config(**short)).train(fused_data, tmp_path / "fused", progress=False,
                                                                init=init)
    assert fused.history[0].agreement == plain.history[0].agreement
    assert fused.history[0].agreement[0] > 0.5  # a trained head's agreement, not two zeros
    assert load_head(tmp_path / "fused")[0].config.fuse_layers == FUSE


def test_fused_training_refuses_data_without_the_layers(target_model, tmp_path_factory, tmp_path):
    target = CausalLM(target_model, name="tiny-target")
    plain_data = tiny_training_data(tmp_path_factory, target_model)
    with pytest.raises(UnsupportedOptionError, match=r"not at \[0, 1\].*--fuse-layers 0,1"):
        HeadTrainer(target, train_config(epochs=1)).train(plain_data, tmp_path / "out", progress=False)


def test_a_folder_with_fused_layers_serves_unfused_heads_too(target_model, fused_data, tmp_path):
    target = CausalLM(target_model, name="tiny-target")
    # Building it again without fuse_layers finds it complete (the layers it holds are kept, nothing is redone).
    stamps = [p.stat().st_mtime_ns for p in sorted(fused_data.glob("shard-*.pt"))]
    prompts = [random_prompt(100 + i, length=8) for i in range(48)]
    build_data(target, None, prompts, fused_data, max_new_tokens=40, max_length=128, shard_size=16, batch_size=8)
    assert [p.stat().st_mtime_ns for p in sorted(fused_data.glob("shard-*.pt"))] == stamps
    head, result = HeadTrainer(target, train_config(fuse_layers=(), epochs=2, eval_every=5)).train(
        fused_data, tmp_path / "plain", progress=False)
    assert head.fuse_fc is None and result.best is not None


def test_cli_fuse_layers_checks(target_model, tmp_path, monkeypatch, capsys):
    from jointspec.cli import main as cli

    argv = train_cli_argv(monkeypatch, target_model, tmp_path, "head")
    assert cli.main(argv + ["--head", "medusa", "--fuse-layers", "1"]) == 2
    assert "--fuse-layers is for --head eagle or --head eagle3 drafts" in capsys.readouterr().err
    assert cli.main(argv + ["--fuse-layers", "5"]) == 2
    assert "fuse layers [5] are out of range: the target has 2 decoder layers" in capsys.readouterr().err
    assert cli.main(argv + ["--fuse-layers", "1", "--epochs", "1"]) == 0
    assert load_head(tmp_path / "head")[0].config.fuse_layers == (1,)
