"""EAGLE-3 heads (drafts/eagle3.py): the speculators format written and read back, the adapter's chains and trees,
every head method greedy-exact with one, and the checkpoints it refuses. The comparison with speculators' own model
class is in test_interop_speculators.py. Deterministic (greedy, fp32): no false-failure odds beyond an exact argmax tie,
which the tiny models' sharpened heads make negligible."""

from __future__ import annotations

import json

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import ModelLoadError, UnsupportedOptionError
from jointspec.drafts.artifact import target_fingerprint
from jointspec.drafts.eagle import HeadDraftModel
from jointspec.drafts.eagle3 import (
    Eagle3Config,
    Eagle3DraftModel,
    Eagle3Head,
    bind_eagle3,
    load_eagle3_artifact,
    save_eagle3_layout,
    save_speculators,
)
from jointspec.drafts.registry import bind_trained_draft
from jointspec.kernels.grouped import GroupedInt8Linear
from jointspec.train.data import build_data
from jointspec.train.eagle3 import Eagle3TrainConfig, Eagle3Trainer

from helpers import (
    assert_greedy_equivalent,
    assert_head_keeps_a_window,
    decoder_for,
    fixed_length_decoder,
    greedy,
    random_prompt,
    run_cli,
    steady_tree_costs,
    tiny_llama,
    tiny_tokenizer,
    train_cli_argv,
)

AUX = (0, 2, 3)


@pytest.fixture(scope="module")
def target4():
    """conftest's tiny Llama with 4 decoder layers, so that three distinct target layers can be read."""
    return tiny_llama(0, layers=4)


def random_head(target_model, seed: int = 0, draft_vocab_size: int | None = 50, **config) -> Eagle3Head:
    """An EAGLE-3 head for ``target_model`` with random weights large enough to move its drafts, drafting every
    other target token (so some tokens are outside its vocabulary)."""
    target = CausalLM(target_model)
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target, target_fingerprint(target), draft_vocab_size=draft_vocab_size,
                                              aux_layers=AUX, **config))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
        if draft_vocab_size:
            head.draft_vocab.copy_(torch.arange(0, 2 * draft_vocab_size, 2))
        # Start from the target's own LM head rows, as training does: the head then drafts what the target says
        # often enough for every method to accept some drafts and reject others.
        head.lm_head.weight.copy_(target_model.lm_head.weight[head.draft_vocab.to(target_model.device)])
    return head.to(target_model.device)


def exported(target_model, head: Eagle3Head, folder) -> str:
    return str(save_speculators(head, folder, "tiny-target", target_model.get_input_embeddings().weight))


def primed(target_model, draft_of, context: list[int]):
    """A draft bound to a target whose cache (and feature mirror) holds ``context`` but its last token."""
    target = CausalLM(target_model, name="tiny-target")
    draft = draft_of(target)
    target.forward(context[:-1], num_logits=0)
    return draft


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_export_then_import_drafts_the_same_chains_and_trees(target4, tmp_path, norm_before_residual):
    head = random_head(target4, norm_before_residual=norm_before_residual)
    folder = exported(target4, head, tmp_path / "e3")
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert config["norm_before_residual"] == norm_before_residual
    context = random_prompt(3)
    tokens, parents = [7, 8, 9, 10, 11], [-1, -1, 0, 0, 1]
    outputs = []
    for draft_of in (lambda target: Eagle3DraftModel(head, target), lambda target: bind_eagle3(folder, target)):
        draft = primed(target4, draft_of, context)
        chain = draft.forward(context + [5, 6]).logits  # the last two entries read the head's own outputs
        tree = draft.forward(tokens, parents=parents).logits
        outputs.append((chain, tree))
    # float32 weights written and read back: the very same numbers.
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    # Tokens outside the draft vocabulary are never drafted.
    outside = torch.ones(outputs[0][0].shape[-1], dtype=torch.bool)
    outside[torch.arange(0, 100, 2)[:50]] = False
    assert torch.isneginf(outputs[0][0][:, outside.to(outputs[0][0].device)]).all()


def test_tree_rows_equal_each_branch_fed_alone(target4):
    head = random_head(target4, seed=1)
    context = random_prompt(5)
    tokens, parents = [7, 8, 9, 10, 11], [-1, -1, 0, 0, 1]
    draft = primed(target4, lambda target: Eagle3DraftModel(head, target), context)
    draft.forward(context)
    tree = draft.forward(tokens, parents=parents).logits
    for path in ([0, 2], [0, 3], [1, 4]):
        branch = primed(target4, lambda target: Eagle3DraftModel(head, target), context)
        branch.forward(context)
        rows = branch.forward([tokens[i] for i in path]).logits
        torch.testing.assert_close(tree[path], rows, rtol=1e-4, atol=1e-4)


def test_the_first_entry_is_seen_by_no_later_entry(target4):
    # vLLM's EAGLE-3 draft has no entry for the first token (it has no feature before it): jointspec keeps one, which
    # must not change what later entries compute, whatever its token.
    head = random_head(target4, seed=2)
    context = random_prompt(6)
    rows = []
    for first in (context[0], (context[0] + 1) % 99):
        draft = primed(target4, lambda target: Eagle3DraftModel(head, target), context)
        rows.append(draft.forward([first] + context[1:]).logits[1:])
    assert torch.equal(rows[0], rows[1])


@pytest.fixture(scope="module")
def trained_eagle3(tmp_path_factory, target4):
    """An EAGLE-3 head trained (a few seconds) on target4's own greedy answers to 48 random prompts."""
    target = CausalLM(target4, name="tiny-target")
    folder = tmp_path_factory.mktemp("eagle3")
    build_data(target, None, [random_prompt(100 + i) for i in range(48)], folder / "data", max_new_tokens=24,
               batch_size=16, fuse_layers=AUX, progress=False)
    config = Eagle3TrainConfig(draft_vocab_size=None, epochs=40, batch_tokens=512, learning_rate=3e-3,
                               warmup_steps=10, eval_every=40, patience=100, eval_fraction=0.1, fuse_layers=AUX)
    _, result = Eagle3Trainer(target, config).train(folder / "data", folder / "head", progress=False)
    return folder / "head", result


def test_training_time_test_raises_agreement_at_every_depth(trained_eagle3):
    _, result = trained_eagle3
    first, best = result.history[0].agreement, result.best.agreement
    assert len(best) == 3  # three training-time-test passes: depths 1 to 3
    # When written: 0.19 / 0.14 / 0.11 after the first 40 steps, 0.38 / 0.32 / 0.23 at the best evaluation.
    assert all(b >= f + 0.05 for b, f in zip(best, first)) and best[0] >= 0.3


# sps without its cost-aware default: timed on a loaded machine, its curve can leave nothing worth drafting.
@pytest.mark.parametrize("method,config", [("sps", {"num_draft_tokens": 4, "cost_aware": False}),
                                           ("specinfer", {"tree": (2, 2)}),
                                           ("mtad", {"num_draft_tokens": 3, "beam_width": 2}),
                                           ("hybrid-tree", {})])
def test_methods_with_an_eagle3_draft_are_greedy_exact(target4, trained_eagle3, tmp_path, monkeypatch, method,
                                                       config):
    if method == "hybrid-tree":
        steady_tree_costs(monkeypatch)
    target = CausalLM(target4)
    folder = exported(target4, bind_eagle3(trained_eagle3[0], target).head, tmp_path / "e3")
    decoder = fixed_length_decoder(target4, method, folder, **config)
    accepted = drafted = 0
    for prompt_seed in (0, 3):
        decoder.generate(random_prompt(prompt_seed), greedy(40))
        accepted, drafted = accepted + decoder.stats.num_accepted_tokens, drafted + decoder.stats.num_draft_tokens
        # (A chain of this head's drafts is not always kept on one prompt: the trees' are.)
        assert_greedy_equivalent(target4, decoder, random_prompt(prompt_seed), drafts_kept=method != "sps")
    assert 0 < accepted < drafted  # the head drafted, was sometimes right and sometimes wrong


def test_an_eagle3_head_windowed_on_a_long_prompt_is_greedy_exact(target4, trained_eagle3, tmp_path, monkeypatch):
    """EAGLE-3 heads keep a long context's sinks and window as EAGLE-style heads do (test_drafts_eagle.py)."""
    monkeypatch.setattr(HeadDraftModel, "window", 8)
    target = CausalLM(target4)
    folder = exported(target4, bind_eagle3(trained_eagle3[0], target).head, tmp_path / "e3")
    prompt = random_prompt(3, length=30)
    assert_head_keeps_a_window(target, bind_eagle3(folder, target), prompt)
    assert_greedy_equivalent(target4, fixed_length_decoder(target4, "specinfer", folder, tree=(2, 2)), prompt)


def test_jointspec_saved_head_binds_by_fingerprint(target4, tmp_path):
    head = random_head(target4, seed=4)
    head.save(tmp_path / "own")
    loaded, _ = load_eagle3_artifact(tmp_path / "own")
    assert loaded.config == head.config and loaded.config.kind == "eagle3"
    draft = bind_trained_draft(tmp_path / "own", CausalLM(target4))
    assert isinstance(draft, Eagle3DraftModel)
    with pytest.raises(ModelLoadError, match="trained for target"):
        bind_trained_draft(tmp_path / "own", CausalLM(tiny_llama(7, layers=4)))


def rewrite_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if key.startswith("layer_"):
            config["transformer_layer_config"][key[len("layer_"):]] = value
        else:
            config[key] = value
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes,needle", [
    ({"norm_output": True}, "sets norm_output"),
    ({"fc_norm": True}, "sets fc_norm"),
    ({"layer_num_hidden_layers": 2}, "one-layer EAGLE-3 heads only"),
    ({"layer_model_type": "qwen3"}, "Llama-style EAGLE-3 layers only"),
    ({"target_hidden_size": 64}, "as wide as their target"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}, r"reads target layers \[0, 2, 4\]; target .* has layers 0 to 3"),
])
def test_checkpoints_it_cannot_run_faithfully_are_refused(target4, tmp_path, changes, needle):
    folder = tmp_path / "e3"
    exported(target4, random_head(target4), folder)
    rewrite_config(folder, **changes)
    with pytest.raises(ModelLoadError, match=needle):
        bind_eagle3(folder, CausalLM(target4))


def _zeros_like(state, name):
    return torch.zeros_like(state[name])


@pytest.mark.parametrize("change,needle", [
    (lambda state: state.update(d2t=state["d2t"][:40]), "d2t map of 40 entries for 50 draft tokens"),
    (lambda state: state["d2t"].__setitem__(-1, 60), "points outside the 99-token vocabulary"),
    (lambda state: state.update({"fc.weight": state["fc.weight"][:, :64]}), "does not match its config.json"),
    (lambda state: state.update({"fc.bias": torch.zeros(32)}), "does not implement: fc.bias"),
    (lambda state: state.update({"layers.1.mlp.up_proj.weight": _zeros_like(state, "layers.0.mlp.up_proj.weight")}),
     "does not implement: layers.1.mlp.up_proj.weight"),
    (lambda state: state.update({"embed_tokens.weight": torch.zeros(120, 32)}), "120 x 32 embedding"),
])
def test_checkpoints_whose_weights_disagree_with_their_config_are_refused_by_name(target4, tmp_path, change,
                                                                                   needle):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "e3"
    exported(target4, random_head(target4), folder)
    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=needle):
        bind_eagle3(folder, CausalLM(target4))


def test_a_checkpoint_for_another_shape_of_target_is_refused(target4, tmp_path):
    folder = tmp_path / "e3"
    exported(target4, random_head(target4), folder)
    wider = CausalLM(tiny_llama(0, vocab=120, layers=4))
    with pytest.raises(ModelLoadError, match="drafts for 99 tokens; target .* has 120"):
        bind_eagle3(folder, wider)
    with pytest.raises(FileExistsError, match="exists"):
        exported(target4, random_head(target4), folder)  # never written over


def test_train_draft_eagle3_then_export_draft_for_vllm(target4, tmp_path, monkeypatch, capsys):
    from jointspec.cli import export as export_cli

    argv = train_cli_argv(monkeypatch, target4, tmp_path, "head") + ["--head", "eagle3", "--fuse-layers", "0,2,3"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    saved = json.loads((tmp_path / "head" / "draft.json").read_text())
    assert saved["config"]["kind"] == "eagle3" and saved["config"]["aux_layers"] == [0, 2, 3]
    assert "--head eagle3" in saved["training"]["command"] and "--unroll 3" in saved["training"]["command"]
    monkeypatch.setattr(export_cli, "load_target",
                        lambda *args, **kwargs: (CausalLM(target4, name="tiny-target"), tiny_tokenizer()))
    code, out, err = run_cli(capsys, "export-draft", str(tmp_path / "head"), "--format", "speculators", "--out",
                             str(tmp_path / "vllm"), "--verifier", "org/tiny-target")
    assert code == 0, err
    exported_config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert exported_config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    context = random_prompt(4)
    rows = []
    for folder in (tmp_path / "head", tmp_path / "vllm"):  # fp16 weights, written as float32: the same numbers
        draft = primed(target4, lambda target, folder=folder: bind_trained_draft(folder, target), context)
        rows.append(draft.forward(context + [5]).logits)
    assert torch.equal(rows[0], rows[1])
    # What a format cannot hold is refused by name, and nothing is written over.
    code, _, err = run_cli(capsys, "export-draft", str(tmp_path / "head"), "--format", "vllm-eagle", "--out",
                           str(tmp_path / "other"))
    assert code == 2 and "that is the EAGLE-1 layout; an EAGLE-3 head goes as --format speculators" in err
    assert not (tmp_path / "other").exists()
    code, _, err = run_cli(capsys, "export-draft", str(tmp_path / "head"), "--format", "speculators", "--out",
                           str(tmp_path / "vllm"))
    assert code == 2 and "exists" in err


def test_a_speculators_export_names_no_verifier_path_of_this_machine_silently(tmp_path, caplog):
    """Without --verifier, the embedded default's checkpoint named the local copy's folder (this machine's cache) as
    its verifier; it names the model's hub id now, and a user's own folder is named with a warning."""
    from types import SimpleNamespace

    from jointspec.backends.embedded import HUB_ID
    from jointspec.cli.export import _verifier_name

    def target(name):
        return SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(_name_or_path=name)))

    assert _verifier_name("default", target("/root/.cache/jointspec/models/smollm2")) == HUB_ID
    assert _verifier_name("org/model", target("org/model")) == "org/model" and not caplog.records
    assert _verifier_name(str(tmp_path), target(str(tmp_path))) == str(tmp_path)
    assert "this machine's path" in caplog.text and "--verifier" in caplog.text


def test_head_agreement_scores_an_eagle3_head_at_each_depth(target4, trained_eagle3, tmp_path, monkeypatch, capsys):
    from jointspec.cli import head_agreement as head_agreement_cli

    monkeypatch.setattr(head_agreement_cli, "load_target",
                        lambda *args, **kwargs: (CausalLM(target4, name="tiny-target"), tiny_tokenizer()))
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": str(i), "category": "c", "turns": [text]}) + "\n"
                               for i, text in enumerate(["please answer question one", "short python value",
                                                         "two more sentences please", "return the value"])))
    folder = str(trained_eagle3[0])
    code, out, err = run_cli(capsys, "head-agreement", "--sets", str(prompts), "--num-prompts", "4",
                             "--max-new-tokens", "24", folder)
    assert code == 0, err
    row = json.loads(out.splitlines()[-1])[folder][str(prompts)]
    assert len(row["per_depth"]) == 3 and row["tokens"] > 50
    assert 0.0 < row["per_depth"][0] <= 1.0


# What SGLang's LlamaForCausalLMEagle3.load_weights reads (python/sglang/srt/models/llama_eagle3.py, docs/interop.md):
# the layer as midlayer.*, q/k/v and gate/up stacked by name, d2t as the draft-to-target offsets, t2d skipped.
SGLANG_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
                "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
                *(f"midlayer.self_attn.{name}_proj.weight" for name in "qkvo"),
                *(f"midlayer.mlp.{name}_proj.weight" for name in ("gate", "up", "down"))}


def test_the_original_eagle3_layout_for_sglang_round_trips(target4, trained_eagle3, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    from jointspec.cli import export as export_cli

    monkeypatch.setattr(export_cli, "load_target",
                        lambda *args, **kwargs: (CausalLM(target4, name="tiny-target"), tiny_tokenizer()))
    code, _, err = run_cli(capsys, "export-draft", str(trained_eagle3[0]), "--format", "eagle3", "--out",
                           str(tmp_path / "sglang"))
    assert code == 0, err
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    # Each engine's numbering: vLLM's top-level key as ours (the input of layer i); SGLang's eagle_config by the
    # output of layer v, captured as the input of layer v + 1 (sglang/srt/models/llama.py,
    # set_eagle3_layers_to_capture).
    assert config["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]
    assert config["rope_theta"] == target4.config.rope_parameters["rope_theta"]  # SGLang's layer reads it there
    assert config["draft_vocab_size"] == config["vocab_size"] == 99  # trained on the full vocabulary
    state = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    assert set(state) == SGLANG_NAMES
    context = random_prompt(4)
    rows = [primed(target4, lambda target, folder=folder: bind_trained_draft(folder, target), context)
            .forward(context + [5]).logits for folder in (trained_eagle3[0], tmp_path / "sglang")]
    assert torch.equal(rows[0], rows[1])
    # A checkpoint SGLang's tools wrote names its layers in eagle_config alone, by their outputs.
    del config["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "sglang" / "config.json").write_text(json.dumps(config))
    assert bind_eagle3(tmp_path / "sglang", CausalLM(target4)).head.config.aux_layers == AUX
    # A checkpoint of this layout that does not name its layers reads EAGLE-3's default for the target (2, L/2, L-3).
    del config["eagle_config"]
    (tmp_path / "sglang" / "config.json").write_text(json.dumps(config))
    assert bind_eagle3(tmp_path / "sglang", CausalLM(target4)).head.config.aux_layers == (2, 2, 1)
    # SGLang's layer takes its residual before hidden_norm: a head that does not is refused, not written.
    with pytest.raises(UnsupportedOptionError, match="norm_before_residual"):
        save_eagle3_layout(random_head(target4, norm_before_residual=True), tmp_path / "nbr")
    assert not (tmp_path / "nbr").exists()


def test_int8_weights_where_the_kernel_takes_them_change_drafts_never_outputs(tmp_path, monkeypatch, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    wide = LlamaForCausalLM(config).eval()  # every linear's in_features a multiple of 64: the int8 kernel takes it
    with torch.no_grad():
        wide.lm_head.weight.mul_(8.0)
    head = random_head(wide, seed=6)
    folder = exported(wide, head, tmp_path / "e3")
    context = random_prompt(2)
    drafts = {}
    for weights in ("float32", "int8"):
        draft = primed(wide, lambda target, weights=weights: bind_eagle3(folder, target, weights), context)
        assert draft.weights == weights
        assert (type(draft.head.lm_head) is GroupedInt8Linear) == (weights == "int8")
        assert type(draft.head.fc) is torch.nn.Linear  # the raw hidden states' outliers: fc stays float
        drafts[weights] = draft.forward(context + [5, 6]).logits
    assert bind_eagle3(folder, CausalLM(wide)).weights == "int8"  # auto takes it where it runs
    finite = torch.isfinite(drafts["float32"])
    error = (drafts["int8"] - drafts["float32"])[finite].abs().max()
    assert 0 < error < 0.05 * drafts["float32"][finite].abs().max()  # int8 groups of 32: close, not equal
    decoder = decoder_for(wide, "sps", folder, num_draft_tokens=4, head_weights="int8")
    assert_greedy_equivalent(wide, decoder, random_prompt(0), drafts_kept=False)  # random weights
    # export-draft writes the weights as trained, even where binding would run them on int8.
    from jointspec.cli import export as export_cli

    monkeypatch.setattr(export_cli, "load_target", lambda *args, **kwargs: (CausalLM(wide), tiny_tokenizer()))
    for layout in ("speculators", "eagle3"):
        code, _, err = run_cli(capsys, "export-draft", folder, "--format", layout, "--out", str(tmp_path / layout))
        assert code == 0, err
        again = primed(wide, lambda target, layout=layout: bind_eagle3(tmp_path / layout, target, "float32"), context)
        assert torch.equal(again.forward(context + [5, 6]).logits, drafts["float32"])
    narrow = tiny_llama(0, layers=4, device="cpu")  # 32 wide
    with pytest.raises(UnsupportedOptionError, match="multiple of 64"):
        bind_eagle3(exported(narrow, random_head(narrow), tmp_path / "narrow"), CausalLM(narrow), "int8")


def test_training_warm_starts_from_an_eagle3_checkpoint_made_elsewhere(target4, tmp_path, monkeypatch, capsys):
    # A checkpoint of the speculators layout (what vLLM serves) starts a --head eagle3 run: its target layers, weights
    # and vocabulary carry over, and the saved head belongs to this target (a fingerprint it then binds by).
    head = random_head(target4, seed=7)
    exported(target4, head, tmp_path / "published")
    argv = train_cli_argv(monkeypatch, target4, tmp_path, "warm") + ["--head", "eagle3", "--init",
                                                                     str(tmp_path / "published")]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    saved = json.loads((tmp_path / "warm" / "draft.json").read_text())
    assert saved["config"]["aux_layers"] == list(AUX) and "--fuse-layers 0,2,3" in saved["training"]["command"]
    assert saved["config"]["target_fingerprint"] == target_fingerprint(CausalLM(target4))
    assert saved["training"]["init"]["folder"] == str(tmp_path / "published")
    warm, _ = load_eagle3_artifact(tmp_path / "warm")
    assert torch.equal(warm.draft_vocab.cpu(), head.draft_vocab.cpu())
    assert isinstance(bind_trained_draft(tmp_path / "warm", CausalLM(target4)), Eagle3DraftModel)
    # An EAGLE-3 checkpoint starts EAGLE-3 heads only.
    code, _, err = run_cli(capsys, *train_cli_argv(monkeypatch, target4, tmp_path, "other"),
                           "--init", str(tmp_path / "published"))
    assert code == 2 and "starts --head eagle3 drafts only" in err


def test_exports_and_saved_heads_are_readable_by_others_as_the_umask_allows(target4, tmp_path):
    # safetensors writes owner-only files and mkdtemp owner-only folders; a server running as another user must
    # still load what train-draft and export-draft wrote.
    import os
    import stat

    previous = os.umask(0o022)
    try:
        head = random_head(target4)
        exported(target4, head, tmp_path / "e3")
        head.save(tmp_path / "own")
    finally:
        os.umask(previous)
    for path in (tmp_path / "e3", tmp_path / "own"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755
        for item in path.iterdir():
            assert stat.S_IMODE(item.stat().st_mode) == 0o644, item
