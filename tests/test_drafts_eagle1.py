"""EAGLE-1 heads in the layout vLLM and SGLang load, read by ``--draft DIR`` (drafts/eagle1.py).

The reference is transformers' own Llama stack with the two EAGLE-1 changes made by hand (no input norm on layer 0,
no final norm), run over the whole sequence at once without a cache: jointspec's cached, segment-by-segment draft
must give its logits, with the target's LM head, at every committed and drafted position. Greedy equivalence with an
imported head is exact by construction; malformed checkpoints are refused by name. No test here samples: none has
false-failure odds.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import ModelLoadError
from jointspec.drafts.artifact import is_head_artifact
from jointspec.drafts.eagle import HeadDraftModel
from jointspec.drafts.eagle1 import bind_eagle1
from jointspec.drafts.registry import bind_trained_draft

from helpers import (
    VOCAB,
    assert_greedy_equivalent,
    assert_head_keeps_a_window,
    decoder_for,
    grouped_llama,
    random_prompt,
    run_cli,
    sps_acceptance,
    tiny_training_data,
    train_cli_argv,
    untrained_draft_of,
)

HIDDEN = 32  # conftest's tiny target


def _config(layers: int, hidden: int = HIDDEN, **extra) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_size": hidden, "intermediate_size": 48 if hidden == HIDDEN else 2 * hidden,
            "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": layers, "rms_norm_eps": 1e-6, "rope_theta": 5000.0, "hidden_act": "silu",
            "max_position_embeddings": 256, **extra}


def _reference(config: dict, seed: int = 5) -> tuple[nn.Linear, LlamaModel]:
    """fc and transformers' Llama layers as EAGLE-1 runs them (no input norm on layer 0, no final norm), random."""
    torch.manual_seed(seed)
    llama = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "logit_scale")})
    model = LlamaModel(llama).eval()
    with torch.no_grad():  # norms away from 1, so that reading one that should not be there would show
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    model.layers[0].input_layernorm = nn.Identity()
    model.norm = nn.Identity()
    fc = nn.Linear(2 * llama.hidden_size, llama.hidden_size, bias=True)
    return fc, model


def _write(folder, config: dict, fc: nn.Linear, model: LlamaModel, *, prefix: str = "", file: str = "model.safetensors",
           extra: dict | None = None, drop: tuple[str, ...] = ()):
    from safetensors.torch import save_file

    state = {f"fc.{name}": value for name, value in fc.state_dict().items()}
    state.update({name: value for name, value in model.state_dict().items() if name.startswith("layers.")})
    state["embed_tokens.weight"] = torch.zeros(VOCAB, fc.out_features)  # the engines read the target's, and so do we
    state.update(extra or {})
    state = {prefix + name: value.contiguous() for name, value in state.items() if name not in drop}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if file.endswith(".safetensors"):
        save_file(state, str(folder / file))
    else:
        torch.save(state, folder / file)
    return folder


def _reference_outputs(fc, model, target_model, tokens: list[int], features: list[torch.Tensor]) -> torch.Tensor:
    """The head's outputs for entries 1..len(tokens)-1, entry p fed token p and feature ``features[p - 1]``."""
    embeds = target_model.get_input_embeddings()(torch.tensor(tokens[1:], device=target_model.device)).float().cpu()
    inputs = fc(torch.cat([embeds, torch.stack(features).cpu()], dim=-1))[None]
    positions = torch.arange(1, len(tokens))[None]
    return model(inputs_embeds=inputs, position_ids=positions).last_hidden_state[0]


@pytest.mark.parametrize("layers,prefix,file,scale", [(1, "", "model.safetensors", None),
                                                     (2, "model.", "pytorch_model.bin", 0.5)])
@torch.no_grad()
def test_eagle1_head_drafts_what_the_engines_compute(target_model, tmp_path, layers, prefix, file, scale):
    config = _config(layers, **({"logit_scale": scale} if scale else {}))
    fc, model = _reference(config)
    folder = _write(tmp_path / "eagle1", config, fc, model, prefix=prefix, file=file)
    assert is_head_artifact(folder)
    target = CausalLM(target_model, name="tiny-target")
    draft = bind_trained_draft(folder, target, "float32")
    context = random_prompt(4)
    target.reset()
    target.forward(context[:-1], num_logits=0)  # true features for positions 0 .. len(context) - 2
    draft.reset()
    drafted = [7, 11]
    logits = draft.forward(context + drafted).logits.cpu()
    lm = target_model.lm_head.weight.float().cpu() * (scale or 1.0)
    true = [draft.mirror.features[p].float().cpu() for p in range(len(context) - 1)]  # the reference runs on the CPU
    # Committed entries read true features; each drafted entry reads the head's output one before it.
    tokens = context + drafted
    features = list(true)
    for _ in drafted:
        outputs = _reference_outputs(fc, model, target_model, tokens[:len(features) + 1], features)
        features.append(outputs[-1])
    outputs = _reference_outputs(fc, model, target_model, tokens, features)
    torch.testing.assert_close(logits[1:], outputs @ lm.T, rtol=1e-4, atol=1e-4)
    # A tree of two siblings after the context: each scores as the chain through it would.
    draft.crop(len(context))
    tree = draft.forward([7, 9], parents=[-1, -1]).logits.cpu()
    torch.testing.assert_close(tree[0], logits[len(context)], rtol=1e-4, atol=1e-4)
    sibling = _reference_outputs(fc, model, target_model, context + [9], features[:len(context)])
    torch.testing.assert_close(tree[1], sibling[-1] @ lm.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["sps", "hybrid-tree"])
def test_imported_eagle1_head_decodes_exactly_greedy(target_model, tmp_path, method):
    config = _config(1)
    fc, model = _reference(config)
    folder = _write(tmp_path / "eagle1", config, fc, model)
    decoder = decoder_for(target_model, method, folder, num_draft_tokens=4, cost_aware=False)
    assert_greedy_equivalent(target_model, decoder, random_prompt(9), drafts_kept=False)  # random weights


def test_imported_eagle1_head_windowed_on_a_long_prompt_decodes_exactly_greedy(target_model, tmp_path, monkeypatch):
    monkeypatch.setattr(HeadDraftModel, "window", 8)
    config = _config(1)
    folder = _write(tmp_path / "eagle1", config, *_reference(config))
    target = CausalLM(target_model)
    prompt = random_prompt(9, length=30)
    assert_head_keeps_a_window(target, bind_eagle1(folder, target), prompt)
    decoder = decoder_for(target_model, "hybrid-tree", folder, num_draft_tokens=4, cost_aware=False)
    assert_greedy_equivalent(target_model, decoder, prompt, drafts_kept=False)  # random weights


def test_int8_weights_change_drafts_never_outputs(tmp_path):
    """Where the int8 kernel takes the layers (64 wide), ``auto`` runs the layers and the LM head on it, fc in float;
    the drafts move a little, the output not at all."""
    from jointspec.kernels.grouped import GroupedInt8Linear

    wide = grouped_llama(0)
    config = _config(1, hidden=64)
    folder = _write(tmp_path / "eagle1", config, *_reference(config))
    context = random_prompt(2)
    logits = {}
    for weights in ("float32", "int8"):
        target = CausalLM(wide, name="wide")
        draft = bind_trained_draft(folder, target, weights)
        assert draft.weights == weights and type(draft.head.fc) is nn.Linear
        assert (type(draft.head.layers[0].mlp.down_proj) is GroupedInt8Linear) == (weights == "int8")
        target.reset()
        target.forward(context[:-1], num_logits=0)
        draft.reset()
        logits[weights] = draft.forward(context + [5, 6]).logits[1:]
    assert bind_trained_draft(folder, CausalLM(wide, name="wide")).weights == "int8"  # auto takes it where it runs
    error = (logits["int8"] - logits["float32"]).abs().max()
    assert 0 < error < 0.05 * logits["float32"].abs().max()  # int8 groups of 32: close, not equal
    decoder = decoder_for(wide, "sps", folder, num_draft_tokens=4, head_weights="int8", cost_aware=False)
    assert_greedy_equivalent(wide, decoder, random_prompt(0), drafts_kept=False)  # random weights


@pytest.mark.parametrize("change,message", [
    (dict(drop=("layers.0.mlp.down_proj.weight",)), "lacks layers.0.mlp.down_proj.weight"),
    (dict(extra={"layers.0.input_layernorm.weight": torch.ones(HIDDEN)}),
     "does not implement: layers.0.input_layernorm.weight"),
    (dict(extra={"norm.weight": torch.ones(HIDDEN)}), "does not implement: norm.weight"),
    (dict(extra={"fc.weight": torch.zeros(HIDDEN, HIDDEN)}), r"fc.weight \(32, 32\), not \(32, 64\)"),
    (dict(extra={"embed_tokens.weight": torch.zeros(VOCAB + 1, HIDDEN)}), r"embed_tokens.weight \(100, 32\)"),
    (dict(config={"add_para_norm": True}), "sets add_para_norm"),
    (dict(config={"hidden_act": "gelu"}), "jointspec reads Llama-style EAGLE-1 layers only"),
    (dict(config={"vocab_size": VOCAB + 1}), "drafts for 100 tokens; target 'tiny-target' has 99"),
    (dict(config={"hidden_size": 64, "intermediate_size": 64}), "is 64 wide; target 'tiny-target' is 32 wide"),
])
def test_malformed_eagle1_checkpoints_are_refused_by_name(target_model, tmp_path, change, message):
    config = _config(1)
    fc, model = _reference(config)
    folder = _write(tmp_path / "eagle1", {**config, **change.pop("config", {})}, fc, model, **change)
    with pytest.raises(ModelLoadError, match=message):
        bind_trained_draft(folder, CausalLM(target_model, name="tiny-target"))


def test_export_draft_says_an_eagle1_checkpoint_is_exported_already(tmp_path, capsys):
    config = _config(1)
    folder = _write(tmp_path / "eagle1", config, *_reference(config))
    code, _, err = run_cli(capsys, "export-draft", str(folder), "--format", "medusa", "--out", str(tmp_path / "x"))
    assert code == 2 and "EAGLE-1 checkpoint for another engine already" in err, err


# -- EAGLE-1 heads trained here (train-draft --head eagle1) and written for the engines ----------------------------

@pytest.fixture(scope="module")
def trained_eagle1(tmp_path_factory, target_model):
    from jointspec.train.eagle1 import Eagle1Trainer
    from jointspec.train.heads import HeadTrainConfig

    data = tiny_training_data(tmp_path_factory, target_model)
    config = HeadTrainConfig(draft_vocab_size=None, epochs=30, batch_tokens=512, learning_rate=3e-3,
                             warmup_steps=10, eval_every=40, patience=100, eval_fraction=0.1)
    folder = tmp_path_factory.mktemp("eagle1")
    Eagle1Trainer(CausalLM(target_model, name="tiny-target"), config).train(data, folder, progress=False)
    return folder


def test_training_an_eagle1_head_raises_acceptance(target_model, trained_eagle1, tmp_path):
    """Seeded; a run gave 0.47 trained against 0.02 untrained (the margins below leave room for thread counts)."""
    from jointspec.drafts.eagle1 import Eagle1Config, Eagle1Head

    untrained_draft_of(Eagle1Head, Eagle1Config, CausalLM(target_model)).save(tmp_path)
    rates = {"trained": sps_acceptance(target_model, trained_eagle1, 3),
             "untrained": sps_acceptance(target_model, tmp_path, 3)}
    assert rates["trained"] > 0.3 and rates["trained"] > rates["untrained"] + 0.2, rates
    decoder = decoder_for(target_model, "hybrid-tree", trained_eagle1, num_draft_tokens=4, cost_aware=False)
    assert_greedy_equivalent(target_model, decoder, random_prompt(3))


@torch.no_grad()
def test_exported_eagle1_heads_draft_the_same_in_both_layouts(target_model, trained_eagle1, tmp_path, monkeypatch,
                                                              capsys):
    """export-draft writes the trained head for vLLM and for SGLang; each checkpoint, read back as the engines read it
    (drafts/eagle1.py's reader, held to the engines' forward above), drafts exactly what the head drafts here."""
    from safetensors.torch import load_file

    from jointspec.cli import export as export_cli

    monkeypatch.setattr(export_cli, "load_target", lambda *args, **kwargs: (CausalLM(target_model), None))
    context = random_prompt(6)

    def drafted(folder):
        target = CausalLM(target_model, name="tiny-target")
        draft = bind_trained_draft(folder, target, "float32")
        target.reset()
        target.forward(context[:-1], num_logits=0)
        draft.reset()
        return draft.forward(context + [5, 6]).logits

    ours = drafted(trained_eagle1)
    for layout, architecture in (("vllm-eagle", "EagleLlamaForCausalLM"), ("sglang-eagle", "LlamaForCausalLMEagle")):
        code, _, err = run_cli(capsys, "export-draft", str(trained_eagle1), "--format", layout, "--out",
                               str(tmp_path / layout))
        assert code == 0, err
        config = json.loads((tmp_path / layout / "config.json").read_text())
        assert config["architectures"] == [architecture] and config["vocab_size"] == VOCAB
        state = load_file(str(tmp_path / layout / "model.safetensors"))
        assert torch.equal(state["fc.bias"], torch.zeros(HIDDEN))  # SGLang's fc has a bias: written, as zeros
        assert "layers.0.input_layernorm.weight" not in state and "norm.weight" not in state
        assert torch.equal(drafted(tmp_path / layout), ours)


def test_export_refuses_what_the_engines_would_draft_otherwise(target_model, tmp_path, monkeypatch, capsys):
    from jointspec.cli import export as export_cli
    from jointspec.drafts.artifact import target_fingerprint
    from jointspec.drafts.eagle1 import Eagle1Config, Eagle1Head

    monkeypatch.setattr(export_cli, "load_target", lambda *args, **kwargs: (CausalLM(target_model), None))
    target = CausalLM(target_model)
    trimmed = untrained_draft_of(Eagle1Head, Eagle1Config, target, draft_vocab_size=50)
    trimmed.save(tmp_path / "trimmed")
    code, _, err = run_cli(capsys, "export-draft", str(tmp_path / "trimmed"), "--format", "sglang-eagle", "--out",
                           str(tmp_path / "x"))
    assert code == 2 and "drafts over 50 of 99 tokens" in err and "--draft-vocab 0" in err, err
    torch.manual_seed(0)
    biased = Eagle1Head(Eagle1Config.for_target(target, target_fingerprint(target), fc_bias=True))
    with torch.no_grad():
        biased.fc.bias.uniform_(-0.1, 0.1)
    biased.save(tmp_path / "biased")
    code, _, err = run_cli(capsys, "export-draft", str(tmp_path / "biased"), "--format", "vllm-eagle", "--out",
                           str(tmp_path / "y"))
    assert code == 2 and "vLLM's EAGLE-1 drops" in err, err
    code, _, err = run_cli(capsys, "export-draft", str(tmp_path / "biased"), "--format", "sglang-eagle", "--out",
                           str(tmp_path / "z"))
    assert code == 0, err
    code, _, err = run_cli(capsys, "export-draft", str(tmp_path / "biased"), "--format", "speculators", "--out",
                           str(tmp_path / "w"))
    assert code == 2 and "an EAGLE-1 head goes as --format vllm-eagle or sglang-eagle" in err, err
    assert not any((tmp_path / name).exists() for name in "xyw")


def test_train_draft_head_eagle1_drafts_over_the_whole_vocabulary_by_default(target_model, tmp_path, monkeypatch,
                                                                             capsys):
    from jointspec.cli import main as cli
    from jointspec.drafts.eagle1 import load_eagle1_artifact

    argv = train_cli_argv(monkeypatch, target_model, tmp_path, "e1")
    at = argv.index("--draft-vocab")
    argv = argv[:at] + argv[at + 2:] + ["--head", "eagle1", "--epochs", "1"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    head, training = load_eagle1_artifact(tmp_path / "e1")
    assert head.config.draft_vocab_size is None and head.draft_vocab.numel() == VOCAB
    assert "--head eagle1" in training["command"] and "--draft-vocab 0" in training["command"]
    assert cli.main(argv[:-4] + ["--head", "eagle1", "--fuse-layers", "1", "--out", str(tmp_path / "f")]) == 2
    assert "--fuse-layers is for --head eagle or --head eagle3 drafts" in capsys.readouterr().err


def test_published_llama_named_and_sharded_heads_are_read_and_full_models_are_not(target_model, tmp_path):
    """The EAGLE repository's heads name LlamaForCausalLM (vLLM renames it); a head's weight names tell them from a
    model. Sharded weights (an .index.json) read as one file."""
    from safetensors.torch import save_file

    from jointspec.drafts.artifact import is_eagle1_checkpoint

    config = _config(1)
    fc, model = _reference(config)
    named = _write(tmp_path / "named", config, fc, model)
    published = _write(tmp_path / "published", {**config, "architectures": ["LlamaForCausalLM"]}, fc, model,
                       file="pytorch_model.bin")
    assert is_eagle1_checkpoint(published)
    target_model.save_pretrained(tmp_path / "model")  # a whole Llama model, safetensors: not a head
    assert not is_eagle1_checkpoint(tmp_path / "model")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps({**config, "architectures": ["EagleLlamaForCausalLM"]}))
    from safetensors.torch import load_file

    state = load_file(str(named / "model.safetensors"))
    halves = [dict(list(state.items())[:5]), dict(list(state.items())[5:])]
    for i, half in enumerate(halves):
        save_file(half, str(sharded / f"model-0000{i + 1}-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: f"model-0000{i + 1}-of-00002.safetensors" for i, half in enumerate(halves)
                        for name in half}}))
    context = random_prompt(5)
    logits = []
    for folder in (named, published, sharded):
        target = CausalLM(target_model, name="tiny-target")
        draft = bind_trained_draft(folder, target, "float32")
        target.reset()
        target.forward(context[:-1], num_logits=0)
        draft.reset()
        logits.append(draft.forward(context + [5]).logits)
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


@pytest.mark.parametrize("extra,message", [
    ({"rope_scaling": {"rope_type": "yarn"}}, "describes no Llama layer transformers can build"),
    ({"num_attention_heads": 5}, "describes no Llama layer transformers can build"),
])
def test_configs_transformers_cannot_build_are_refused_by_name(target_model, tmp_path, extra, message):
    config = _config(1)
    folder = _write(tmp_path / "eagle1", {**config, **extra}, *_reference(config))
    with pytest.raises(ModelLoadError, match=message):
        bind_trained_draft(folder, CausalLM(target_model, name="tiny-target"))
