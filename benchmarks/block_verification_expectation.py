"""Block against token-wise verification on the same drafts: each verifier's expected kept length, round by round.

``jointspec bench`` compares ``sps`` and ``sps:verify=block`` as two runs: different sampled answers, so different
drafts, and each round's kept length drawn once. Both are noise next to the difference (about 1 % in tokens per
round for the shipped SmolLM2 head, docs/lab/benchmarks.md section 14). Here one decode per prompt (token-wise
``sps`` with the target's shipped head, fixed ``--num-draft-tokens``, seeded) runs as usual, and every round's draft
is also scored by :func:`jointspec.verifiers.block.expected_kept_lengths`: the draft tokens each verifier keeps of
that draft on average over its own uniforms. So the two are compared on identical drafts and target rows, with no
draw noise; what remains is which prompts and drafts occurred. Reported: tokens per round (kept + the one token
every round emits) of each, their ratio with the bench's 95 % paired bootstrap over prompts, and the kept length
the token-wise run actually drew (it should match its expectation).

    python benchmarks/block_verification_expectation.py --num-per-category 10        # all 80 MT-Bench first turns
    python benchmarks/block_verification_expectation.py --quantize auto --num-draft-tokens 3
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import torch

from jointspec.backends.loading import load_model
from jointspec.bench.intervals import paired_ratio_interval
from jointspec.bench.prompts import chat_prompt_ids, load_prompts
from jointspec.bench.runner import _cpu_name
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig, processed_probs
from jointspec.methods import MethodConfig, MethodContext, build_method
from jointspec.verifiers.block import expected_kept_lengths


class ScoringVerifier:
    """Verifies as ``inner`` does, and records each chain draft's expected kept length under both verifiers."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.rounds: list[tuple[float, float, int]] = []  # (token-wise expected, block expected, kept as drawn)

    def __getattr__(self, name):  # the loop reads the inner verifier's flags
        return getattr(self.inner, name)

    def verify(self, draft, target_logits, sampling, generator):
        verdict = self.inner.verify(draft, target_logits, sampling, generator)
        if draft.draft_probs is not None and draft.num_nodes and not sampling.greedy:
            rows = processed_probs(target_logits, sampling)
            token_wise, block = expected_kept_lengths(rows, draft.draft_probs, list(draft.token_ids))
            self.rounds.append((token_wise, block, len(verdict.accepted)))
        return verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantize", default="none", help="the target's weights (default: float32, where heads pay)")
    parser.add_argument("--draft", default=None, help="a draft (default: the head shipped for the target)")
    parser.add_argument("--prompts", default="builtin:mt_bench")
    parser.add_argument("--num-per-category", type=int, default=3)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.temperature <= 0:
        parser.error("--temperature must be > 0: at temperature 0 both verifiers keep exactly the greedy matches")
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.model, quantize=args.quantize)
    config = MethodConfig(name="sps", draft=args.draft, num_draft_tokens=args.num_draft_tokens, cost_aware=False)
    context = MethodContext(config, target, tokenizer, lambda source: load_model(source))
    drafter, verifier = build_method(context)
    scoring = ScoringVerifier(verifier)
    decoder = SpeculativeDecoder(target, drafter, scoring)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, eos_token_ids=context.eos_token_ids())
    by_category: dict[str, list] = {}
    for prompt in load_prompts(args.prompts):
        by_category.setdefault(prompt.category, []).append(prompt)
    prompts = [p for group in by_category.values() for p in group[:args.num_per_category]]
    per_prompt = []  # [token-wise tokens, block tokens, drawn tokens, rounds] summed over a prompt's rounds
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        scoring.rounds.clear()
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
        decoder.generate(ids, decode, torch.Generator().manual_seed(args.seed + index))
        rounds = scoring.rounds
        per_prompt.append([sum(1 + r[0] for r in rounds), sum(1 + r[1] for r in rounds),
                           sum(1 + r[2] for r in rounds), len(rounds)])
        print(f"\r{index + 1}/{len(prompts)} prompts", end="", flush=True)
    print()
    parts = torch.tensor(per_prompt, dtype=torch.float64)
    rounds = float(parts[:, 3].sum())
    token_wise, block, drawn = (float(parts[:, k].sum()) / rounds for k in range(3))
    interval = paired_ratio_interval(parts[:, [1, 3]], parts[:, [0, 3]], "rate")
    report = {"cpu": _cpu_name(), "threads": torch.get_num_threads(), "model": args.model,
              "quantize": args.quantize, "prompts": len(prompts), "rounds": int(rounds),
              "num_draft_tokens": args.num_draft_tokens, "sampling": asdict(sampling),
              "seconds": round(time.perf_counter() - start, 1),
              "tokens_per_round": {"token_wise_expected": token_wise, "block_expected": block,
                                   "token_wise_drawn": drawn},
              "block_over_token_wise": None if interval is None else
              {"ratio": interval.ratio, "low": interval.low, "high": interval.high}}
    print(f"{report['cpu']}, {report['threads']} threads; {len(prompts)} prompts, {int(rounds)} rounds of "
          f"{args.num_draft_tokens} drafted tokens")
    print(f"tokens per round: token-wise {token_wise:.4f} expected ({drawn:.4f} drawn), block {block:.4f} expected")
    if interval is not None:
        print(f"block / token-wise: {interval.ratio:.4f} [{interval.low:.4f}, {interval.high:.4f}]")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
