"""Teacher-forced agreement of draft heads with the target on benchmark answers (not on the heads' training data).

A head's held-out agreement during training is measured on answers to prompts shaped like its training prompts, which
can flatter it. This script asks the same question on the built-in benchmark sets: the target answers the first
``--num-prompts`` questions (taken round-robin over categories) greedily, and each head is scored, teacher-forced, on
every answer position: does its depth-1 draft equal the target's argmax, does its depth-2 draft (drafted from its own
depth-1 feature, as in decoding) equal the next argmax, and is the target's token in its depth-1 top 2 and top 3
(what trees of width 2 and 3 could catch). Depth-1 agreement is what first-position acceptance in greedy decoding
converges to.

Medusa and Hydra heads and distilled drafts (``train-draft --head medusa|hydra`` / ``--kind distill``) are scored by
their trainer's own held-out evaluation on the same answers: per Medusa or Hydra head k, does its guess equal the
target's token k places on (a Hydra head reading the target's own tokens before it, as after accepted drafts); for a
distilled draft, does its next token equal the target's (one depth: it reads tokens, not its own features).

    python scripts/head_agreement.py --num-prompts 8 src/jointspec/data/drafts/smollm2-135m-instruct-eagle OTHER_HEAD

The target's answers and features are computed once per run and shared by all heads. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

from jointspec.api import GenerationConfig, Pipeline
from jointspec.bench.prompts import load_prompts
from jointspec.methods import MethodConfig
from jointspec.drafts.artifact import artifact_kind, check_head_target, float_lm_weight
from jointspec.drafts.eagle import load_head
from jointspec.train.heads import HeadTrainConfig, HeadTrainer


def round_robin(prompts, count: int):
    by_category: dict[str, list] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    ordered = [group[i] for i in range(max(map(len, by_category.values()))) for group in by_category.values()
               if i < len(group)]
    return ordered[:count]


def target_answers(pipe: Pipeline, prompt_set: str, count: int, max_new_tokens: int):
    """(token ids of prompt + answer, prompt length, the target's hidden states: all layers) per prompt."""
    items = []
    for prompt in round_robin(load_prompts(f"builtin:{prompt_set}"), count):
        prompt_ids = pipe.encode(prompt.turns[0])
        answer = pipe.generate_ids(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens)).token_ids
        sequence = prompt_ids + list(answer)
        with torch.inference_mode():
            out = pipe.target.model(input_ids=torch.tensor([sequence]), output_hidden_states=True, logits_to_keep=1,
                                    use_cache=False)
        items.append((sequence, len(prompt_ids), [h[0].float() for h in out.hidden_states]))
    return items


def features_of(hidden_states, layers=(-1,)) -> torch.Tensor:
    """[T, hidden * len(layers)]: what a head with these feature layers reads (the last feature first)."""
    return torch.cat([hidden_states[layer] for layer in layers], -1)


def score(head, trainer: HeadTrainer, target_lm_weight: torch.Tensor, items) -> dict:
    vocab = head.draft_vocab
    draft_weight = target_lm_weight.index_select(0, vocab)
    hits, top2, top3, count = [0, 0], 0, 0, 0
    for sequence, prompt_length, hidden_states in items:
        target_argmax = (hidden_states[-1] @ target_lm_weight.T).argmax(-1)
        features = features_of(hidden_states, head.config.feature_layers)
        with torch.inference_mode():
            outputs = trainer._passes(head, torch.tensor([sequence]), features[None], None, 0.0)
        # The head's output at position t drafts the token after t + 1; score the answer's positions only.
        answer = slice(prompt_length - 1, len(sequence) - 2)
        wanted = target_argmax[1:][answer]
        for depth, predicted in enumerate(outputs):
            logits = (predicted[0] @ draft_weight.T)[answer]
            hits[depth] += int((vocab[logits.argmax(-1)] == wanted).sum())
            if depth == 0:
                found = (vocab[logits.topk(3, -1).indices] == wanted[:, None]).long().cumsum(-1)
                top2 += int(found[:, 1].sum())
                top3 += int(found[:, 2].sum())
        count += wanted.numel()
    return {"depth1": round(hits[0] / count, 4), "depth2": round(hits[1] / count, 4),
            "depth1_top2": round(top2 / count, 4), "depth1_top3": round(top3 / count, 4), "tokens": count}


def score_trained(folder: str, pipe: Pipeline, target_lm_weight: torch.Tensor, items) -> dict:
    """Agreement per depth of Medusa or Hydra heads or a distilled draft, by its trainer's evaluation (answers
    only)."""
    from jointspec.cli.train import trainer_for_kind

    config_class, trainer_class, load = trainer_for_kind(artifact_kind(folder))
    draft, _ = load(folder)
    check_head_target(draft, folder, pipe.target)
    trainer = trainer_class(pipe.target, config_class(batch_tokens=1 << 20))
    sequences = [(torch.tensor(sequence), hidden[-1], prompt_length) for sequence, prompt_length, hidden in items]
    labels_of = [(hidden[-1] @ target_lm_weight.T).argmax(-1) for _, _, hidden in items]
    vocab = draft.draft_vocab
    draft_index = torch.full((target_lm_weight.shape[0],), -1, dtype=torch.long)
    draft_index[vocab] = torch.arange(vocab.shape[0])
    result = trainer.evaluate(draft, sequences, labels_of, target_lm_weight.index_select(0, vocab), draft_index, 0)
    return {"depth1": result.agreement[0], "per_depth": result.agreement,
            "tokens": sum(len(s) - p + 1 for s, p, _ in items)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("heads", nargs="+", help="draft folders written by train-draft (any kind)")
    parser.add_argument("--target", default="default")
    parser.add_argument("--sets", default="mt_bench,humaneval", help="built-in prompt sets, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=8, help="per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    pipe = Pipeline.load(args.target, MethodConfig(name="ar"))
    target_lm_weight = float_lm_weight(pipe.target.model).detach().float()
    trainer = HeadTrainer(pipe.target, HeadTrainConfig(unroll=2))
    answers = {name: target_answers(pipe, name, args.num_prompts, args.max_new_tokens)
               for name in args.sets.split(",")}
    results = {}
    for folder in args.heads:
        if artifact_kind(folder) in ("medusa", "hydra", "distill"):
            results[folder] = {name: score_trained(folder, pipe, target_lm_weight, items)
                               for name, items in answers.items()}
            for name, row in results[folder].items():
                depths = ", ".join(f"{a:.1%}" for a in row["per_depth"])
                print(f"{folder}  {name}: by depth {depths} (~{row['tokens']} tokens)", flush=True)
            continue
        head, _ = load_head(folder)
        check_head_target(head, folder, pipe.target)
        head.eval()
        results[folder] = {name: score(head, trainer, target_lm_weight, items) for name, items in answers.items()}
        for name, row in results[folder].items():
            print(f"{folder}  {name}: depth 1 {row['depth1']:.1%}, depth 2 {row['depth2']:.1%}, "
                  f"top 2 {row['depth1_top2']:.1%}, top 3 {row['depth1_top3']:.1%} ({row['tokens']} tokens)",
                  flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
