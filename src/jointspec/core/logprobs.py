"""Log-probabilities of the tokens a decode commits: what OpenAI's ``logprobs`` and ``top_logprobs`` ask for.

Every committed token follows one row of the target's logits: the row of its parent in the round's forward (row 0
for the round's first token, the row after accepted draft node ``i`` for the token after it). A token's
log-probability is that row's ``log_softmax`` at the token, from the target's raw logits: temperature 1, before
top-k, top-p and a grammar's mask, as vLLM reports them by default. So the figures are the model's own, whichever
method drafted the token and however the request samples: a method's answers can be scored under the target (their
perplexity) from the answers themselves. Where a forward read a screened head (greedy rows, sampled rows with a
top-k, draws), its logits are not whole; the loop then asks for the rows' hidden states and the exact head's logits
of the committed rows alone (the target's ``logits_of``, core/target.py), and the tokens stay those the screen
chose.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# OpenAI's limit on a chat request's top_logprobs (its completions take 5; this server takes up to this many there too).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's log-probability under the target, and the row's ``top`` most likely tokens (most likely
    first, as (token id, log-probability) pairs; as many as the request asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top_logprobs(top: int | None, name: str = "logprobs") -> None:
    """Raise ValueError unless ``top`` is None (no log-probabilities) or a count from 0 to :data:`MAX_TOP_LOGPROBS`."""
    if top is not None and (isinstance(top, bool) or not isinstance(top, numbers.Integral)
                            or not 0 <= top <= MAX_TOP_LOGPROBS):  # (numpy's ints are Integral)
        raise ValueError(f"{name} must be a whole number from 0 to {MAX_TOP_LOGPROBS} (the most likely tokens to list "
                         f"beside each chosen one), got {top!r}")


def token_logprobs(rows: torch.Tensor, token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """``rows`` [n, vocab]: the raw logits each of ``token_ids`` (n of them) was chosen from, in order. Returns each
    token's log-probability and its row's ``top`` most likely tokens."""
    if rows.shape[0] != len(token_ids):
        raise ValueError(f"{rows.shape[0]} rows of logits for {len(token_ids)} tokens")
    if not token_ids:
        return []
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    best: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if top:
        values, indices = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)
        best = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return [TokenLogprob(int(token), float(value), tuple(pairs))
            for token, value, pairs in zip(token_ids, chosen, best)]


def json_logprob(value: float) -> float:
    """A log-probability as JSON can hold it: minus infinity (a token the model gives no chance, which only a grammar
    or a NaN row lets through) and NaN become -9999.0, as OpenAI's API and vLLM write them."""
    return value if math.isfinite(value) else -9999.0
