"""Teacher-forced agreement of trained drafts with the target on benchmark answers (not on the drafts' training data).

A head's held-out agreement during training is measured on answers to prompts shaped like its training prompts, which
can flatter it. This asks the same question on benchmark prompts: the target answers the first ``count`` questions of
a set (taken round-robin over categories) greedily, and each EAGLE head is scored, teacher-forced, on every answer
position: does its depth-1 draft equal the target's argmax, does its depth-2 draft (drafted from its own depth-1
feature, as in decoding) equal the next argmax, and is the target's token in its depth-1 top 2 and top 3 (what trees
of width 2 and 3 could catch). Depth-1 agreement is what first-position acceptance in greedy decoding converges to.
The top-w shares are what ``default`` sizes its one-level tree by (:mod:`jointspec.methods.tree_width`), read from
``measured.top_w_hit_rate`` in the head's ``draft.json``: :func:`record_top_w_hit_rate` writes them there.

Medusa and Hydra heads and distilled drafts are scored by their trainer's own held-out evaluation on the same
answers (:func:`score_trained`): per Medusa or Hydra head k, does its guess equal the target's token k places on; for
a distilled draft, does its next token equal the target's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from jointspec.api import GenerationConfig, Pipeline
from jointspec.bench.prompts import BenchPrompt
from jointspec.core.files import replacing
from jointspec.drafts.artifact import CONFIG_FILE

TOP_W = (1, 2, 3)


@dataclass(frozen=True)
class TargetAnswer:
    """A prompt and the target's greedy answer, with the target's hidden states (every layer) along it."""

    sequence: list[int]
    prompt_length: int
    hidden_states: list[torch.Tensor]


def round_robin(prompts: list[BenchPrompt], count: int) -> list[BenchPrompt]:
    """The first ``count`` prompts taking one of each category in turn, so a few prompts span the categories."""
    by_category: dict[str, list] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    ordered = [group[i] for i in range(max(map(len, by_category.values()), default=0))
               for group in by_category.values() if i < len(group)]
    return ordered[:count]


def target_answers(pipe: Pipeline, prompts: list[BenchPrompt], count: int, max_new_tokens: int,
                   progress: str | None = None) -> list[TargetAnswer]:
    """The target's greedy answers to the first turn of ``count`` of ``prompts`` (round-robin over categories);
    ``progress``: a bar on stderr with this label."""
    answers = []
    for prompt in tqdm(round_robin(prompts, count), desc=progress, unit="prompt", disable=progress is None):
        prompt_ids = pipe.encode(prompt.turns[0])
        answer = pipe.generate_ids(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens)).token_ids
        sequence = list(prompt_ids) + list(answer)
        with torch.inference_mode():
            out = pipe.target.model(input_ids=torch.tensor([sequence], device=pipe.target.device),
                                    output_hidden_states=True, logits_to_keep=1, use_cache=False)
        # Scored on the CPU, where the trainers' passes run.
        answers.append(TargetAnswer(sequence, len(prompt_ids), [h[0].float().cpu() for h in out.hidden_states]))
    return answers


@dataclass
class HeadAgreement:
    """Counts over scored answer positions: depth-1 and depth-2 hits, and top-w hits at depth 1 (w = 1, 2, 3)."""

    tokens: int = 0
    depth_hits: list[int] = field(default_factory=lambda: [0, 0])
    top_w_hits: list[int] = field(default_factory=lambda: [0] * len(TOP_W))

    def __add__(self, other: HeadAgreement) -> HeadAgreement:
        return HeadAgreement(self.tokens + other.tokens, [a + b for a, b in zip(self.depth_hits, other.depth_hits)],
                             [a + b for a, b in zip(self.top_w_hits, other.top_w_hits)])

    def top_w_hit_rate(self) -> dict[int, float]:
        """w -> the share of positions whose target token was in the head's top w (nondecreasing in w)."""
        return {w: round(hits / self.tokens, 4) if self.tokens else 0.0 for w, hits in zip(TOP_W, self.top_w_hits)}

    def to_dict(self) -> dict:
        rate = self.top_w_hit_rate()
        return {"depth1": rate[1], "depth2": round(self.depth_hits[1] / self.tokens, 4) if self.tokens else 0.0,
                "depth1_top2": rate[2], "depth1_top3": rate[3], "tokens": self.tokens}


def _features(hidden_states: list[torch.Tensor], layers) -> torch.Tensor:
    """[T, hidden * len(layers)]: what a head with these feature layers reads (the last feature first)."""
    return torch.cat([hidden_states[layer] for layer in layers], -1)


def score_head(head, trainer, target_lm_weight: torch.Tensor, answers: list[TargetAnswer]) -> HeadAgreement:
    """An EAGLE head's agreement with the target on ``answers``' answer positions, teacher-forced; ``trainer`` is a
    :class:`~jointspec.train.heads.HeadTrainer` with ``unroll=2`` (its passes draft depth 1 and 2 as decoding does)."""
    vocab = head.draft_vocab
    draft_weight = target_lm_weight.index_select(0, vocab)
    result = HeadAgreement()
    for item in answers:
        target_argmax = (item.hidden_states[-1] @ target_lm_weight.T).argmax(-1)
        features = _features(item.hidden_states, head.config.feature_layers)
        with torch.inference_mode():
            outputs = trainer._passes(head, torch.tensor([item.sequence]), features[None], None, 0.0)
        # The head's output at position t drafts the token after t + 1; score the answer's positions only.
        positions = slice(item.prompt_length - 1, len(item.sequence) - 2)
        wanted = target_argmax[1:][positions]
        for depth, predicted in enumerate(outputs[:2]):
            logits = (predicted[0] @ draft_weight.T)[positions]
            if depth == 0:
                top = logits.topk(min(len(TOP_W), logits.shape[-1]), -1).indices
                found = (vocab[top] == wanted[:, None]).long().cumsum(-1)
                for i in range(len(TOP_W)):
                    result.top_w_hits[i] += int(found[:, min(i, found.shape[1] - 1)].sum())
                result.depth_hits[0] += int(found[:, 0].sum())
            else:
                result.depth_hits[depth] += int((vocab[logits.argmax(-1)] == wanted).sum())
        result.tokens += wanted.numel()
    return result


def score_trained(draft, trainer, target_lm_weight: torch.Tensor, answers: list[TargetAnswer]) -> dict:
    """Agreement per depth of Medusa or Hydra heads or a distilled draft on ``answers`` (answer positions only), by
    ``trainer``'s own held-out evaluation (the trainer of the draft's kind, built for the target)."""
    # The last feature, then the target layers the draft reads (EAGLE-3's; none for the others), as in a data folder.
    layers = (-1, *getattr(trainer, "fuse_layers", ()))
    sequences = [(torch.tensor(item.sequence), _features(item.hidden_states, layers), item.prompt_length)
                 for item in answers]
    labels_of = [(item.hidden_states[-1] @ target_lm_weight.T).argmax(-1) for item in answers]
    vocab = draft.draft_vocab
    draft_index = torch.full((target_lm_weight.shape[0],), -1, dtype=torch.long)
    draft_index[vocab] = torch.arange(vocab.shape[0])
    result = trainer.evaluate(draft, sequences, labels_of, target_lm_weight.index_select(0, vocab), draft_index, 0)
    return {"depth1": result.agreement[0], "per_depth": result.agreement,
            "tokens": sum(len(item.sequence) - item.prompt_length + 1 for item in answers)}


def record_top_w_hit_rate(folder: str | Path, rates: dict[int, float], how: str) -> Path:
    """Write ``rates`` (w -> share) into ``folder``'s draft.json as ``measured.top_w_hit_rate`` (keys "1", "2", ...)
    with ``measured.how``, keeping everything else; the file is replaced whole or not at all. Returns its path."""
    if not rates or any(not 0.0 <= rate <= 1.0 for rate in rates.values()):
        raise ValueError(f"hit rates must be shares in [0, 1], got {rates}")
    path = Path(folder).expanduser() / CONFIG_FILE
    meta = json.loads(path.read_text(encoding="utf-8"))
    measured = meta.get("measured") if isinstance(meta.get("measured"), dict) else {}
    measured.update({"top_w_hit_rate": {str(w): rates[w] for w in sorted(rates)}, "how": how})
    meta["measured"] = measured
    with replacing(path, f"the head's {CONFIG_FILE}", "it is as it was") as tmp:
        tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.chmod(tmp, path.stat().st_mode & 0o777)  # keep the file's own mode, not the umask's
    return path
