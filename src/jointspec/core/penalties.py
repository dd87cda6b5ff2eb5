"""Repetition, presence and frequency penalties, and a logit bias: a row's logits changed by the tokens before it
and by fixed amounts per token.

As vLLM applies them (and OpenAI's API its two penalties and ``logit_bias``), to the raw logits, before the
temperature and every other step of ``core/sampling.py``, greedy decoding included:

0. ``bias`` (none by default): a fixed amount (-100 to 100) added to each listed token's logit, first (vLLM's order:
   its logit-bias processor runs before the penalties); -100 all but bans a token, 100 all but forces it;
1. ``repetition`` (1: off; > 0): every token of the prompt or the answer so far has its logit divided by it where
   positive and multiplied by it where not;
2. ``frequency`` (0: off; -2 to 2): subtracted from a token's logit once for each time the answer holds it;
3. ``presence`` (0: off; -2 to 2): subtracted from the logit of every token the answer holds.

A verified row's history is the committed text and, for a draft node's row, the draft tokens on the path to it: each
row gets the logits plain decoding gives it at that position, so every lossless method stays lossless (greedy: the
same tokens; sampled: the same law). The penalties read every logit of a row, so a penalised decode reads whole rows,
never a screened head's; so does a biased one (a bias moves the argmax the screen looks for).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from jointspec.core.errors import UnsupportedOptionError

# OpenAI's range for a logit bias (vLLM takes the same).
MAX_LOGIT_BIAS = 100.0


def checked_bias(bias) -> tuple[tuple[int, float], ...]:
    """``bias`` (a mapping of token id to amount, or (token id, amount) pairs) as sorted (int, float) pairs; raises
    TypeError / ValueError naming the bad entry."""
    if bias is None:
        return ()
    if not isinstance(bias, Iterable) or isinstance(bias, (str, bytes)):
        raise TypeError(f"logit_bias must map token ids to amounts (a dict, or (token id, amount) pairs), got {bias!r}")
    pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    out: dict[int, float] = {}
    for entry in pairs:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise TypeError(f"logit_bias must map token ids to amounts, got the entry {entry!r}")
        token, amount = entry
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(amount, bool) or not isinstance(amount, numbers.Real):
            raise TypeError(f"logit_bias[{token}] must be a number, got {amount!r}")
        if not math.isfinite(amount):
            raise ValueError(f"logit_bias[{token}] must be a finite number, got {amount!r}")
        if not -MAX_LOGIT_BIAS <= amount <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {amount}")
        if int(token) in out:
            raise ValueError(f"logit_bias lists token {int(token)} twice")
        out[int(token)] = float(amount)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class Penalties:
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    # (token id, amount) pairs, sorted; a mapping is taken too (checked_bias).
    bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "bias", checked_bias(self.bias))
        for name in ("repetition", "presence", "frequency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):  # (numpy's scalars are Real too)
                raise TypeError(f"{name}_penalty must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not 0.0 < self.repetition < float("inf"):
            raise ValueError(f"repetition_penalty must be a positive number (1 = off), got {self.repetition}")
        for name in ("presence", "frequency"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}_penalty must be in [-2, 2] (0 = off), got {getattr(self, name)}")

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0 or bool(self.bias)

    @functools.cached_property
    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bias as (token ids, amounts) tensors, built once (a request's every round reads them)."""
        return (torch.tensor([token for token, _ in self.bias], dtype=torch.long),
                torch.tensor([amount for _, amount in self.bias], dtype=torch.float32))

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a bias on a token id the model does not have (UnsupportedOptionError naming it). The pairs are sorted,
        so the last id decides (penalized_rows checks every round)."""
        if self.bias and self.bias[-1][0] >= vocab_size:
            first = next(token for token, _ in self.bias if token >= vocab_size)
            raise UnsupportedOptionError(f"logit_bias names token id {first}, beyond this model's vocabulary of "
                                         f"{vocab_size}")


NO_PENALTIES = Penalties()


def penalized_rows(logits: torch.Tensor, tokens: Sequence[int], prompt_length: int, paths: Sequence[Sequence[int]],
                   penalties: Penalties) -> torch.Tensor:
    """``logits`` [rows, vocab] with row r penalised by its history: ``tokens`` (the prompt, its first
    ``prompt_length``, then the answer so far) followed by ``paths[r]`` (the draft tokens before the row's
    position). A new tensor; ``logits`` is left as it is."""
    if len(paths) != logits.shape[0]:
        raise ValueError(f"{len(paths)} histories for {logits.shape[0]} rows of logits")
    out = logits.float().clone()
    if not penalties.active:
        return out
    device, vocab = out.device, out.shape[-1]
    if penalties.bias:
        penalties.check_vocab(vocab)
        ids, amounts = penalties.bias_tensors
        out[:, ids.to(device)] += amounts.to(device=device, dtype=out.dtype)
    tokens = torch.as_tensor(list(tokens), dtype=torch.long)
    answer = tokens[prompt_length:]
    for row, path in enumerate(paths):
        path = torch.as_tensor(list(path), dtype=torch.long)
        if penalties.repetition != 1.0:
            seen = torch.cat([tokens, path]).unique()
            seen = seen[seen < vocab].to(device)
            values = out[row, seen]
            out[row, seen] = torch.where(values > 0, values / penalties.repetition, values * penalties.repetition)
        if penalties.presence or penalties.frequency:
            ids, counts = torch.cat([answer, path]).unique(return_counts=True)
            keep = ids < vocab
            ids, counts = ids[keep].to(device), counts[keep].to(device=device, dtype=out.dtype)
            out[row, ids] -= penalties.frequency * counts + penalties.presence
    return out
