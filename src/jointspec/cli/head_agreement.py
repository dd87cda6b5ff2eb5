"""``jointspec head-agreement``: teacher-forced agreement of trained drafts with the target on benchmark answers, and
``--record``: write a head's measured top-w hit rates into its draft.json (what ``default`` sizes its tree by).

    jointspec head-agreement --num-prompts 24 --sets mt_bench,humaneval drafts/own drafts/sg
    jointspec head-agreement --num-prompts 24 --sets mt_bench --record drafts/own

The target's answers and features are computed once and shared by every draft. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jointspec.backends.loading import load_model
from jointspec.cli.commands import command_help

# Test seam: tests replace this with a function returning a tiny in-process (CausalLM, tokenizer).
load_target = load_model

# Kinds scored by their trainer's own evaluation (one top-1 agreement per depth, no top-w shares to record).
TRAINED_KINDS = ("eagle3", "medusa", "hydra", "distill")


def add_parser(subparsers) -> None:
    from jointspec.cli.options import positive_int

    parser = subparsers.add_parser(
        "head-agreement", help=command_help("head-agreement"),
        description="The target answers the first --num-prompts questions of each set greedily (round-robin over "
                    "categories); each draft is scored teacher-forced on every answer position. EAGLE heads: depth-1 "
                    "and depth-2 agreement and whether the target's token is in the head's top 2 and 3; Medusa and "
                    "Hydra heads and distilled drafts: agreement per depth, by their trainer's evaluation. The last "
                    "stdout line is JSON.")
    parser.add_argument("drafts", nargs="+", metavar="DRAFT_DIR",
                        help="draft folders written by train-draft (any kind)")
    parser.add_argument("--target", default="default", help="target model: 'default', a folder, a .gguf or a hub id")
    parser.add_argument("--quantize", choices=("auto", "none", "int8", "int4"), default="auto",
                        help="the target's weights, as `jointspec generate --quantize` (default: auto)")
    parser.add_argument("--sets", default="mt_bench,humaneval",
                        help="comma-separated prompt sets: built-in names (mt_bench, humaneval, grounded, long) or "
                             "MT-Bench-style JSONL files")
    parser.add_argument("--num-prompts", type=positive_int, default=8, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="length of the target's answers")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    parser.add_argument("--record", action="store_true",
                        help="write each EAGLE head's top-1/2/3 hit rates, pooled over the sets, into its draft.json "
                             "as measured.top_w_hit_rate (what `default` sizes its tree by)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr (model loading's too)")
    parser.set_defaults(run=run)


def _prompt_source(name: str) -> str:
    from jointspec.bench.prompts import BUILTIN_PREFIX

    if name.startswith(BUILTIN_PREFIX) or Path(name).expanduser().is_file() or name.endswith(".jsonl"):
        return name
    return BUILTIN_PREFIX + name


def _draft_kinds(folders: list[str], record: bool) -> dict[str, str]:
    """folder -> the kind of draft it holds; refuses a folder without one (or --record on a kind it cannot record)
    before any model loads."""
    from jointspec.core.errors import ModelLoadError, UnsupportedOptionError
    from jointspec.drafts.artifact import artifact_kind

    kinds = {}
    for folder in folders:
        kind = artifact_kind(folder)
        if kind is None:
            raise ModelLoadError(f"'{folder}' holds no readable draft.json; pass folders written by "
                                 "`jointspec train-draft`")
        if record and kind in TRAINED_KINDS:
            raise UnsupportedOptionError(f"--record writes top-w hit rates, which head-agreement measures for "
                                         f"'eagle' and 'eagle1' heads only; '{folder}' holds a '{kind}' draft")
        kinds[folder] = kind
    return kinds


def _load_drafts(kinds: dict[str, str], target) -> dict:
    """folder -> (kind, draft), each checked against the target, before any answer is generated."""
    from jointspec.drafts.artifact import check_head_target
    from jointspec.train.kinds import trainer_for_kind

    drafts = {}
    for folder, kind in kinds.items():
        draft, _ = trainer_for_kind(kind)[2](folder)
        check_head_target(draft, folder, target)
        drafts[folder] = (kind, draft.eval())
    return drafts


def run(args: argparse.Namespace) -> int:
    import torch

    from jointspec.api import Pipeline
    from jointspec.bench.head_agreement import (
        HeadAgreement,
        record_top_w_hit_rate,
        score_head,
        score_trained,
        target_answers,
    )
    from jointspec.bench.prompts import load_prompts
    from jointspec.core.errors import JointspecError
    from jointspec.drafts.artifact import float_lm_weight
    from jointspec.methods import MethodConfig
    from jointspec.train.heads import HeadTrainConfig, HeadTrainer
    from jointspec.train.kinds import trainer_for_kind

    if args.threads:
        torch.set_num_threads(args.threads)
    sets = [name.strip() for name in args.sets.split(",") if name.strip()]
    if not sets:
        raise JointspecError(f"--sets names no prompt set ('{args.sets}'); e.g. --sets mt_bench,humaneval")
    prompts = {name: load_prompts(_prompt_source(name)) for name in sets}  # a bad set fails before the model loads
    empty = [name for name in sets if not prompts[name]]
    if empty:
        raise JointspecError(f"prompt set {', '.join(empty)} holds no prompts")
    kinds = _draft_kinds(args.drafts, args.record)
    target, tokenizer = load_target(args.target, quantize=args.quantize)
    drafts = _load_drafts(kinds, target)
    pipe = Pipeline(target, tokenizer, MethodConfig(name="ar"))
    target_lm_weight = float_lm_weight(target.model).detach().float().cpu()
    answers = {name: target_answers(pipe, prompts[name], args.num_prompts, args.max_new_tokens,
                                    progress=None if args.no_progress else f"target answers ({name})")
               for name in sets}
    head_trainer = HeadTrainer(target, HeadTrainConfig(unroll=2))
    results = {}
    for folder, (kind, draft) in drafts.items():
        if kind in TRAINED_KINDS:
            config_class, trainer_class, _ = trainer_for_kind(kind)
            layers = {"fuse_layers": draft.config.aux_layers} if kind == "eagle3" else {}
            trainer = trainer_class(target, config_class(batch_tokens=1 << 20, **layers))
            results[folder] = {name: score_trained(draft, trainer, target_lm_weight, items)
                               for name, items in answers.items()}
            for name, row in results[folder].items():
                depths = ", ".join(f"{a:.1%}" for a in row["per_depth"])
                print(f"{folder}  {name}: by depth {depths} (~{row['tokens']} tokens)", flush=True)
            continue
        scores = {name: score_head(draft, head_trainer, target_lm_weight, items) for name, items in answers.items()}
        results[folder] = {name: score.to_dict() for name, score in scores.items()}
        for name, row in results[folder].items():
            print(f"{folder}  {name}: depth 1 {row['depth1']:.1%}, depth 2 {row['depth2']:.1%}, "
                  f"top 2 {row['depth1_top2']:.1%}, top 3 {row['depth1_top3']:.1%} ({row['tokens']} tokens)",
                  flush=True)
        if args.record:
            pooled = sum(scores.values(), HeadAgreement())
            if not pooled.tokens:  # rates of 0 % would replace what default sizes its tree by
                raise JointspecError(f"nothing recorded for '{folder}': no answer position was scored (answers of "
                                     f"up to {args.max_new_tokens} new tokens); give --max-new-tokens 2 or more")
            rates = pooled.top_w_hit_rate()
            num_prompts = sum(len(items) for items in answers.values())
            how = (f"teacher-forced on the target's greedy answers to {num_prompts} prompts of {', '.join(sets)} "
                   f"({pooled.tokens} tokens, up to {args.max_new_tokens} new tokens each; jointspec head-agreement): "
                   "how often the head's top w tokens held the target's next token")
            path = record_top_w_hit_rate(folder, rates, how)
            print(f"recorded top-w hit rates {', '.join(f'{w}: {r:.1%}' for w, r in rates.items())} in {path}",
                  file=sys.stderr)
    print(json.dumps(results))
    return 0
