"""Medusa heads made for other engines, read by ``--draft DIR`` (drafts/medusa_checkpoint.py): vLLM's layout (what
``export-draft --format medusa`` writes, and what vLLM's ``medusa.py`` loads) and the Medusa project's
(``medusa_lm_head.pt`` / ``.safetensors``). Each test computes the engine's own forward by hand (or, for the Medusa
project, with a module built as its ``medusa_model.py`` builds it) and checks jointspec's draft logits against it;
greedy equivalence with an imported draft is exact by construction. Malformed checkpoints are refused by name.

No test here samples: none has false-failure odds.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import ModelLoadError
from jointspec.drafts.artifact import float_lm_weight, is_head_artifact
from jointspec.drafts.medusa import MedusaConfig, MedusaHeads, bind_medusa, load_medusa, save_vllm_medusa
from jointspec.drafts.registry import bind_trained_draft

from helpers import (
    VOCAB,
    assert_greedy_equivalent,
    decoder_for,
    greedy,
    random_prompt,
    run_cli,
    untrained_draft_of,
)

HIDDEN = 32  # conftest's tiny target


def _target(target_model) -> CausalLM:
    return CausalLM(target_model, name="tiny-target")


def _draft_rows(draft, target: CausalLM, context: list[int], depths: int):
    """The draft's logits for depths 1..``depths`` after the target has scored ``context[:-1]``, and the feature
    they read (the target's last hidden state at the context's second-to-last position)."""
    target.reset()
    target.forward(context[:-1], num_logits=0)
    draft.reset()
    logits = draft.forward(context + list(range(5, 5 + depths - 1))).logits
    feature = draft.mirror.features[len(context) - 2].float()
    return [logits[len(context) - 2 + k] for k in range(1, depths + 1)], feature


def _write(folder, config: dict, state: dict[str, torch.Tensor], file: str = "model.safetensors"):
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if file.endswith(".safetensors"):
        save_file({name: value.contiguous() for name, value in state.items()}, str(folder / file))
    else:
        torch.save(state, folder / file)
    return folder


def _vllm_checkpoint(folder, *, heads: int = 3, layers: int = 2, bias: bool = False, shared: bool = False,
                     scale: float | None = None, token_map: torch.Tensor | None = None, prefix: str = "",
                     seed: int = 3, extra: dict | None = None, drop: tuple[str, ...] = (), hidden: int = HIDDEN):
    """A random checkpoint in vLLM's Medusa layout; returns its folder and its config and tensors."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for h in range(heads):
        for i in range(layers):
            state[f"blocks.{h}.layers.{i}.weight"] = torch.randn(hidden, hidden, generator=generator) * 0.3
            if bias:
                state[f"blocks.{h}.layers.{i}.bias"] = torch.randn(hidden, generator=generator) * 0.3
    for name in ["lm_head.weight"] if shared else [f"lm_heads.{h}.weight" for h in range(heads)]:
        state[name] = torch.randn(VOCAB, hidden, generator=generator)  # vLLM picks token_map's rows when it is set
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": hidden, "vocab_size": VOCAB,
              "num_heads": heads, "num_hidden_layers": layers, "medusa_fc_bias": bias, "original_lm_head": shared}
    if scale is not None:
        config["logit_scale"] = scale
    if token_map is not None:
        state["token_map"] = token_map
        config["truncated_vocab_size"] = int(token_map.numel())
    state.update(extra or {})
    state = {prefix + name: value for name, value in state.items() if name not in drop}
    return _write(folder, config, state), config, {name[len(prefix):]: value for name, value in state.items()}


def _vllm_logits(config: dict, state: dict, feature: torch.Tensor, h: int) -> torch.Tensor:
    """vLLM's Medusa block ``h`` on ``feature``, written from ``vllm/model_executor/models/medusa.py``: residual
    layers ``x + SiLU(W x [+ b])``, the head's LM head (or the shared one), logits times ``logit_scale``, and with a
    ``token_map`` the drafted rows placed in a full vocabulary of ``-inf``."""
    x = feature
    for i in range(config["num_hidden_layers"]):
        x = x + torch.nn.functional.silu(x @ state[f"blocks.{h}.layers.{i}.weight"].T
                                         + state.get(f"blocks.{h}.layers.{i}.bias", torch.zeros(HIDDEN)))
    lm = state["lm_head.weight"] if config["original_lm_head"] else state[f"lm_heads.{h}.weight"]
    token_map = state.get("token_map")
    if token_map is not None:
        lm = lm[token_map]
    logits = (x @ lm.T) * config.get("logit_scale", 1.0)
    if token_map is None:
        return logits
    full = torch.full((config["vocab_size"],), float("-inf"))
    full[token_map] = logits
    return full


@pytest.mark.parametrize("variant", [
    dict(),  # a head per block, no bias, no map
    dict(bias=True, shared=True, scale=0.5, prefix="medusa_heads."),
    dict(shared=True, token_map=torch.arange(3, 93, 2)),  # 45 drafted tokens, rows picked from the full LM head
])
def test_vllm_layout_drafts_what_vllm_computes(target_model, tmp_path, variant):
    target = _target(target_model)
    folder, config, state = _vllm_checkpoint(tmp_path / "vllm", **variant)
    assert is_head_artifact(folder)
    draft = bind_trained_draft(folder, target)
    rows, feature = _draft_rows(draft, target, random_prompt(4), depths=5)
    feature = feature.cpu()
    for k, row in enumerate(rows, start=1):
        # Past the last head, the last one serves again (as for heads trained here).
        expected = _vllm_logits(config, state, feature, min(k, config["num_heads"]) - 1)
        torch.testing.assert_close(row.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_exported_heads_read_back_draft_the_same_tokens(target_model, tmp_path):
    """jointspec -> vLLM's layout -> jointspec: the same logits at every depth and the same decoding, round for
    round (greedy sps accepts exactly as many drafted tokens, so the drafts were the same)."""
    target = _target(target_model)
    heads = untrained_draft_of(MedusaHeads, MedusaConfig, target, draft_vocab_size=50)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for linear in (m for m in heads.modules() if isinstance(m, nn.Linear)):
            linear.weight.add_(torch.randn(linear.weight.shape, generator=generator) * 0.3)
    heads.save(tmp_path / "ours")
    loaded, _ = load_medusa(tmp_path / "ours")
    save_vllm_medusa(loaded, tmp_path / "vllm", float_lm_weight(target.model))
    context = random_prompt(5)
    ours, _ = _draft_rows(bind_medusa(tmp_path / "ours", target), target, context, depths=6)
    theirs, _ = _draft_rows(bind_trained_draft(tmp_path / "vllm", target), target, context, depths=6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    runs = []
    for folder in (tmp_path / "ours", tmp_path / "vllm"):
        decoder = decoder_for(target_model, "sps", folder, num_draft_tokens=4, cost_aware=False)
        runs.append((decoder.generate(random_prompt(6), greedy(30)), decoder.stats.num_accepted_tokens,
                     decoder.stats.num_draft_tokens))
    assert runs[0] == runs[1]


class _ResBlock(nn.Module):
    """The Medusa project's ResBlock (medusa/model/medusa_model.py): ``x + SiLU(linear(x))``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


@pytest.mark.parametrize("layers,file", [(1, "medusa_lm_head.safetensors"), (2, "medusa_lm_head.pt")])
def test_medusa_project_layout_drafts_what_its_module_computes(target_model, tmp_path, layers, file):
    """Heads as the Medusa project builds them: each a Sequential of ``[ResBlock] * layers`` (one block object
    repeated, so its layers share weights) and its own LM head, saved as ``medusa_head.state_dict()``."""
    torch.manual_seed(7)
    heads = nn.ModuleList(nn.Sequential(*([_ResBlock(HIDDEN)] * layers), nn.Linear(HIDDEN, VOCAB, bias=False))
                          for _ in range(3))
    target = _target(target_model)
    folder = _write(tmp_path / "medusa", {"medusa_num_heads": 3, "medusa_num_layers": layers,
                                          "base_model_name_or_path": "tiny"}, heads.state_dict(), file)
    rows, feature = _draft_rows(bind_trained_draft(folder, target), target, random_prompt(8), depths=4)
    with torch.no_grad():
        for k, row in enumerate(rows, start=1):
            torch.testing.assert_close(row.cpu(), heads[min(k, 3) - 1](feature.cpu()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["sps", "hybrid-tree"])
def test_imported_heads_decode_exactly_greedy(target_model, tmp_path, method):
    folder, _, _ = _vllm_checkpoint(tmp_path / "vllm", bias=True, token_map=torch.arange(0, 90))
    decoder = decoder_for(target_model, method, folder, num_draft_tokens=4, cost_aware=False)
    assert_greedy_equivalent(target_model, decoder, random_prompt(9))


@pytest.mark.parametrize("change,message", [
    (dict(extra={"blocks.0.layers.0.bias": torch.zeros(HIDDEN)}),
     "has weights that layout does not read: blocks.0.layers.0.bias"),
    (dict(extra={"blocks.3.layers.0.weight": torch.zeros(HIDDEN, HIDDEN)}), "does not read: blocks.3.layers.0.weight"),
    (dict(drop=("lm_heads.1.weight",)), "lacks lm_heads.1.weight"),
    (dict(bias=True, drop=("blocks.2.layers.1.bias",)), "lacks blocks.2.layers.1.bias"),
    (dict(hidden=16), "head 0 layer 0 is 16x16; target 'tiny-target' is 32 wide"),
    (dict(token_map=torch.tensor([0, 5, 99])), "has a token_map that is not 3 distinct ids"),
    (dict(token_map=torch.tensor([4, 5, 5])), "has a token_map that is not 3 distinct ids"),
    (dict(extra={"lm_heads.0.weight": torch.zeros(VOCAB + 1, HIDDEN)}),
     "lm_heads.0.weight is 100x32; target 'tiny-target' needs 99x32"),
])
def test_malformed_vllm_checkpoints_are_refused_by_name(target_model, tmp_path, change, message):
    folder, _, _ = _vllm_checkpoint(tmp_path / "vllm", **change)
    with pytest.raises(ModelLoadError, match=message):
        bind_trained_draft(folder, _target(target_model))


@pytest.mark.parametrize("config,message", [
    ({"num_heads": 0}, "num_heads must be a whole number >= 1, got 0"),
    ({"truncated_vocab_size": 40}, "truncates the vocabulary to 40 of 99 tokens but has no token_map"),
    ({"vocab_size": 98}, "has vocab_size 98; target 'tiny-target' has 99"),
])
def test_checkpoints_whose_config_disagrees_are_refused(target_model, tmp_path, config, message):
    folder, written, _ = _vllm_checkpoint(tmp_path / "vllm")
    (folder / "config.json").write_text(json.dumps({**written, **config}))
    with pytest.raises(ModelLoadError, match=message):
        bind_trained_draft(folder, _target(target_model))


def test_folder_without_weights_or_blocks_is_refused(target_model, tmp_path):
    target = _target(target_model)
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    with pytest.raises(ModelLoadError, match="has none of model.safetensors, medusa_lm_head.safetensors"):
        bind_trained_draft(folder, target)
    _write(tmp_path / "other", {"architectures": ["MedusaModel"], "num_heads": 2}, {"w": torch.zeros(2)})
    with pytest.raises(ModelLoadError, match="names no Medusa block"):
        bind_trained_draft(tmp_path / "other", target)


def test_export_draft_says_an_engine_checkpoint_is_exported_already(tmp_path, capsys):
    folder, _, _ = _vllm_checkpoint(tmp_path / "vllm")
    code, _, err = run_cli(capsys, "export-draft", str(folder), "--format", "medusa", "--out", str(tmp_path / "x"))
    assert code == 2 and "Medusa checkpoint for another engine already" in err, err
    assert not (tmp_path / "x").exists()


@torch.no_grad()
def test_medusa_project_files_read_as_its_loader_runs_them(target_model, tmp_path):
    """The project's loader runs five heads whatever the config says (its published configs said two), and one block
    object per head, so the last of a file's differing layer copies is what every layer runs."""
    torch.manual_seed(9)
    heads = nn.ModuleList(nn.Sequential(*([_ResBlock(HIDDEN)] * 2), nn.Linear(HIDDEN, VOCAB, bias=False))
                          for _ in range(3))
    state = heads.state_dict()
    for h in range(3):  # copies that differ, as a file from another trainer may hold
        state[f"{h}.0.linear.weight"] = torch.randn(HIDDEN, HIDDEN)
    heads.load_state_dict(state, strict=False)  # the project's own load: the last copy wins
    folder = _write(tmp_path / "medusa", {"medusa_num_heads": 2, "medusa_num_layers": 2}, state, "medusa_lm_head.pt")
    target = _target(target_model)
    rows, feature = _draft_rows(bind_trained_draft(folder, target), target, random_prompt(8), depths=3)
    for k, row in enumerate(rows, start=1):
        torch.testing.assert_close(row.cpu(), heads[k - 1](feature.cpu()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,message", [
    (dict(token_map=torch.arange(40)), None),  # the map's length must be truncated_vocab_size: set below
    (dict(shared=True, token_map=torch.arange(45), extra={"lm_head.weight": torch.zeros(60, HIDDEN)}),
     "lm_head.weight is 60x32; target 'tiny-target' needs 45x32"),
])
def test_token_map_and_lm_head_rows_that_disagree_are_refused(target_model, tmp_path, change, message):
    folder, written, _ = _vllm_checkpoint(tmp_path / "vllm", **change)
    if message is None:
        (folder / "config.json").write_text(json.dumps({**written, "truncated_vocab_size": 45}))
        message = "has a token_map of 40 ids for truncated_vocab_size 45"
    with pytest.raises(ModelLoadError, match=message):
        bind_trained_draft(folder, _target(target_model))


def test_imported_lm_heads_are_held_once(target_model, tmp_path):
    """One float32 copy of the checkpoint's LM heads, shared by the draft (a 7B model's Medusa heads are GBs)."""
    folder, _, _ = _vllm_checkpoint(tmp_path / "vllm", scale=2.0)
    draft = bind_trained_draft(folder, _target(target_model))
    assert draft.lm_own.data_ptr() == draft.heads.lm_heads.data_ptr()


def test_imported_lm_heads_move_with_the_heads(target_model, tmp_path):
    """Binding to a target moves the heads to its device, LM heads included: a copy left on the CPU beside one on a
    GPU would hold them twice (the test above caught it on CUDA; the meta device shows the same move on a CPU)."""
    from jointspec.drafts.medusa_checkpoint import load_medusa_checkpoint

    folder, _, _ = _vllm_checkpoint(tmp_path / "vllm", scale=2.0)
    heads = load_medusa_checkpoint(folder, _target(target_model)).to("meta")
    assert heads.lm_heads is not None and heads.lm_heads.device.type == "meta"
    assert "lm_heads" not in heads.state_dict()  # the checkpoint's own files keep them, not a jointspec save
