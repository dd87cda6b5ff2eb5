"""EAGLE-3 heads against the ``speculators`` package itself (the format vLLM and SGLang load), both ways:

- a checkpoint that speculators' own ``Eagle3DraftModel`` writes is read by jointspec, whose draft logits equal
  speculators' own forward (its training-time test, three steps) on the same tokens and target hidden states;
- a head jointspec exports is read by speculators' ``from_pretrained``, with the same equality.

speculators pins an older transformers than jointspec's, so it lives in its own virtual environment; these tests run
``tests/interop/speculators_eagle3.py`` with that environment's Python, named by ``JOINTSPEC_SPECULATORS_PYTHON``
(.ci/run builds it). Without it they skip, saying so, except in CI, where they fail. Deterministic float32
arithmetic on both sides: the tolerance (1e-4) covers summation order only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.drafts.artifact import target_fingerprint
from jointspec.drafts.eagle3 import Eagle3Config, Eagle3DraftModel, Eagle3Head, bind_eagle3, save_speculators

from helpers import random_prompt, tiny_llama

pytestmark = pytest.mark.interop

SCRIPT = Path(__file__).parent / "interop" / "speculators_eagle3.py"
AUX = (0, 2, 3)
TTT_STEPS = 3
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def speculators_python() -> str:
    python = os.environ.get("JOINTSPEC_SPECULATORS_PYTHON")
    if not python or not Path(python).is_file():
        reason = ("JOINTSPEC_SPECULATORS_PYTHON does not name a Python with speculators==0.9.0 installed (.ci/run "
                  "builds one: python3 -m venv .venv-speculators; .venv-speculators/bin/pip install torch==2.13.0 "
                  "speculators==0.9.0)")
        if os.environ.get("CI") == "true":  # a skip there would hide a broken claim
            pytest.fail(f"CI: {reason}")
        pytest.skip(reason)
    return python


def speculators(python: str, *args: str) -> None:
    done = subprocess.run([python, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        raise AssertionError(f"speculators job {args[0]} failed (exit {done.returncode})")


@pytest.fixture(scope="module")
def target4(tmp_path_factory):
    """A tiny 4-layer Llama on the CPU, also saved as the verifier folder speculators reads its embedding from."""
    model = tiny_llama(0, layers=4, device="cpu")
    folder = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(folder)
    return model, folder


def speculators_logits(python: str, folder: Path, model, tokens: torch.Tensor, tmp_path: Path) -> list[torch.Tensor]:
    """speculators' own forward of the checkpoint in ``folder``: draft logits of every training-time-test step, row
    ``t`` of step ``k`` drafting token ``t + 2 + k`` from token ``t + 1 + k`` and the target's states at ``t``."""
    with torch.no_grad():
        states = model(tokens[None], output_hidden_states=True).hidden_states
    aux = torch.cat([states[layer][0] for layer in AUX], -1)
    torch.save({"input_ids": tokens[1:], "hidden_states": aux[:-1], "ttt_steps": TTT_STEPS}, tmp_path / "in.pt")
    speculators(python, "score", str(folder), str(tmp_path / "in.pt"), str(tmp_path / "out.pt"))
    return torch.load(tmp_path / "out.pt")["logits"]


def worst_difference(draft_of, model, tokens: torch.Tensor, reference: list[torch.Tensor]) -> float:
    """Largest |jointspec - speculators| over every step and row: for row t of step k, the target has scored tokens
    0..t and the draft is fed tokens 0..t + 1 + k, its last k entries reading its own outputs."""
    worst = 0.0
    for k in range(TTT_STEPS):
        for t in range(len(tokens) - 1 - k):
            target = CausalLM(model)
            draft = draft_of(target)
            target.forward(tokens[:t + 1].tolist(), num_logits=0)
            logits = draft.forward(tokens[:t + 2 + k].tolist()).logits[t + 1 + k]
            worst = max(worst, float((logits[draft.draft_vocab] - reference[k][t]).abs().max()))
    return worst


@pytest.mark.parametrize("norm_before_residual", ["0", "1"])
def test_jointspec_drafts_what_speculators_computes_for_its_own_checkpoint(speculators_python, target4, tmp_path,
                                                                         norm_before_residual):
    model, verifier = target4
    folder = tmp_path / "theirs"
    speculators(speculators_python, "write", str(folder), str(verifier), "50", ",".join(map(str, AUX)),
                norm_before_residual)
    tokens = torch.tensor(random_prompt(1, length=12))
    reference = speculators_logits(speculators_python, folder, model, tokens, tmp_path)
    assert len(reference) == TTT_STEPS and reference[0].shape == (11, 50)
    assert worst_difference(lambda target: bind_eagle3(folder, target), model, tokens, reference) <= TOLERANCE


def test_speculators_computes_what_jointspec_drafts_for_an_exported_head(speculators_python, target4, tmp_path):
    model, verifier = target4
    target = CausalLM(model)
    torch.manual_seed(5)
    head = Eagle3Head(Eagle3Config.for_target(target, target_fingerprint(target), draft_vocab_size=50, aux_layers=AUX,
                                              norm_before_residual=True))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
        head.draft_vocab.copy_(torch.arange(0, 100, 2))
    folder = save_speculators(head, tmp_path / "ours", str(verifier), model.get_input_embeddings().weight)
    tokens = torch.tensor(random_prompt(2, length=12))
    reference = speculators_logits(speculators_python, folder, model, tokens, tmp_path)
    assert worst_difference(lambda target: Eagle3DraftModel(head, target), model, tokens, reference) <= TOLERANCE
    # A head that drafts differently is caught by the same comparison: the check can fail.
    with torch.no_grad():
        head.layer.mlp.down_proj.weight.mul_(1.01)
    assert worst_difference(lambda target: Eagle3DraftModel(head, target), model, tokens, reference) > TOLERANCE
