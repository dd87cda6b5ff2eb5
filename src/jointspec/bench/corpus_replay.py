"""Offline replay of cost-aware corpus lookup over recorded greedy answers: which n-gram table drafts better.

A bench run's ``results.json`` keeps every method's output tokens. A lossless method's greedy output is the target's,
so the rounds ``corpus`` would run on it can be replayed without the model: each round the drafter (cost-aware, as
``default`` runs it on the int4 model) proposes from the context, the tokens that match the recorded answer are
accepted, and the round is charged the target forward it would have needed on a cost curve (relative to one plain
step). Reported: answer tokens per unit of that cost, overall and per turn, for each table. An estimate of the
drafts' worth, not a timing: Python, the draft's own cost and the machine's noise are left out. Only the tokenizer
is needed (to format the turns), so it runs in seconds next to other work.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from jointspec.bench.prompts import BenchPrompt, chat_prompt_ids
from jointspec.core.errors import JointspecError
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.corpus import CorpusLookupDrafter, NgramTable
from jointspec.drafters.costaware import CostAwareDrafter, CostCurve
from jointspec.methods import MethodConfig

# The int4 SmolLM2's forward cost by tokens, relative to a step (docs/lab/benchmarks.md section 5: a 2-token forward
# 1.13x, a 4-token one 1.37x; the rest from that run's curve).
INT4_CURVE = "1:1,2:1.13,3:1.25,4:1.37,5:1.45,8:1.7,16:2.4"


def parse_curve(text: str) -> CostCurve:
    """``tokens:cost`` pairs, comma-separated (costs relative to a 1-token step), as a :class:`CostCurve`."""
    try:
        return CostCurve({int(n): float(c) for n, c in (pair.split(":") for pair in text.split(","))})
    except ValueError as error:
        raise JointspecError(f"bad cost curve '{text}': expected tokens:cost pairs such as 1:1,2:1.13,4:1.37 "
                             f"({error})") from None


def runs_by_prompt(results: dict, method: str, prompts: list[BenchPrompt]) -> list[tuple[BenchPrompt, dict]]:
    """(prompt, run) for each of ``method``'s runs in ``results``, matched by question id (by prompt index in
    ``prompts`` where the run records none)."""
    by_id = {prompt.question_id: prompt for prompt in prompts}
    pairs = []
    for run in sorted((r for r in results["runs"] if r["method"] == method), key=lambda r: r["prompt_index"]):
        question = run.get("question_id")
        prompt = by_id.get(str(question)) if question is not None else None
        if prompt is None and question is None and run["prompt_index"] < len(prompts):
            prompt = prompts[run["prompt_index"]]
        if prompt is None:
            raise JointspecError(f"run of '{method}' on question {question!r} has no prompt in the given set; pass "
                                 "the prompt set that run used (--prompts)")
        pairs.append((prompt, run))
    return pairs


def replay(table: NgramTable, tokenizer, runs: list[tuple[BenchPrompt, dict]],
           curve: CostCurve, progress: str | None = None) -> list[tuple[int, float]]:
    """Per turn: (answer tokens, cost of the rounds that committed them); ``progress``: a bar on stderr with this
    label."""
    config = MethodConfig()
    greedy = SamplingConfig(temperature=0.0)
    totals = [[0, 0.0] for _ in range(max((len(run["output_ids"]) for _, run in runs), default=0))]
    for prompt, run in tqdm(runs, desc=progress, unit="prompt", disable=progress is None):
        drafter = CostAwareDrafter(CorpusLookupDrafter(table, config.num_draft_tokens, config.max_num_draft_tokens,
                                                       max_ngram=config.max_ngram),
                                   curve, max_num_draft_tokens=config.max_num_draft_tokens)
        messages: list[dict[str, str]] = []
        for turn, (text, answer) in enumerate(zip(prompt.turns, run["output_ids"])):
            messages.append({"role": "user", "content": text})
            context = chat_prompt_ids(tokenizer, messages)
            drafter.start(context)
            context = list(context)
            done = 0
            while done < len(answer):
                draft = drafter.propose(context, len(answer) - done - 1, greedy, None).token_ids
                accepted = 0
                while accepted < len(draft) and draft[accepted] == answer[done + accepted]:
                    accepted += 1
                drafter.commit(context, accepted)
                step = min(accepted + 1, len(answer) - done)
                context += answer[done:done + step]
                done += step
                totals[turn][1] += curve.cost(len(draft) + 1)
            totals[turn][0] += len(answer)
            messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
    return [(tokens, cost) for tokens, cost in totals]


def replay_summary(turns: list[tuple[int, float]]) -> dict:
    """Answer tokens per unit of step-cost, overall and by turn."""
    tokens, cost = sum(t for t, _ in turns), sum(c for _, c in turns)
    return {"tokens_per_cost": round(tokens / cost, 4) if cost else None,
            "by_turn": [round(t / c, 4) for t, c in turns if c]}
