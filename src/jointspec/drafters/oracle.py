"""An oracle drafter: it proposes the target's own greedy continuation, with a chosen share of tokens corrupted.

At temperature 0 a clean oracle draft is always accepted, and each corrupted token is always rejected, so the
acceptance is known in advance: the first draft position is accepted with probability ``1 - corruption_rate``, and
a round of ``k`` draft tokens yields on average ``sum((1 - c) ** i for i in range(k + 1))`` tokens. Timing such runs
measures the loop's own overhead against a cost model, free of any drafter's quality (``jointspec bench``).

Where the continuation comes from: the oracle runs the target greedily with its own KV cache (it shares the
target's weights, not its cache). The continuation of each prompt is memoised, so the first generation of a prompt
pays for it (``jointspec bench`` discards that warm-up run) and later ones replay it at almost no cost. When the
committed text leaves the memoised path (sampling at temperature > 0), it drafts greedily from the actual context,
paying ``num_draft_tokens`` target steps per round.

Example, ``corruption_rate=0.25``, ``num_draft_tokens=4``, greedy continuation ``[7, 3, 9, 4, ...]``: each token is
replaced by a different random id with probability 0.25, e.g. ``[7, 3, 51, 4]``; verification keeps ``[7, 3]``.
"""

from __future__ import annotations

import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.draft import EMPTY_DRAFT, Draft
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.model import common_prefix_length, draft_room

# Extend a memoised continuation by at least this many tokens at a time (fewer, longer extensions).
_EXTEND_CHUNK = 16


class OracleDrafter:
    # The first generation of a prompt computes its continuation; a benchmark should run each prompt once untimed.
    warm_per_prompt = True

    def __init__(self, target: CausalLM, num_draft_tokens: int = 4, corruption_rate: float = 0.0,
                 seed: int = 0) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if not 0.0 <= corruption_rate <= 1.0:
            raise ValueError(f"corruption_rate must be in [0, 1], got {corruption_rate}")
        self.model = target.fork(f"{target.name} (oracle)")
        self.vocab_size = target.vocab_size
        self.num_draft_tokens = num_draft_tokens
        self.corruption_rate = corruption_rate
        self.seed = seed
        self._rng = torch.Generator(device="cpu").manual_seed(seed)
        self._continuations: dict[tuple[int, ...], list[int]] = {}
        self._prompt: list[int] = []
        self._cached_ids: list[int] = []  # what self.model's cache holds

    def start(self, prompt_ids: list[int]) -> None:
        # Same corruptions on every run of the same prompt (repeats of a benchmark are alike), different ones on
        # different prompts. Python hashes tuples of ints the same way in every process.
        self._rng.manual_seed((self.seed * 1_000_003 + hash(tuple(prompt_ids))) % 2**63)
        self._prompt = list(prompt_ids)

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        num_tokens = min(self.num_draft_tokens, max_num_draft_tokens)
        if num_tokens <= 0:
            return EMPTY_DRAFT
        continuation = self._continuations.setdefault(tuple(self._prompt), [])
        done = context_ids[len(self._prompt):]
        if continuation[:len(done)] == done:
            missing = len(done) + num_tokens - len(continuation)
            if missing > 0:  # (a chunk at a time, never past the model's context: the loop reads none past it)
                room = draft_room(self.model, self._prompt + continuation)
                if room > 0:
                    continuation.extend(self._greedy(self._prompt + continuation,
                                                     min(max(missing, _EXTEND_CHUNK), room)))
            tokens = continuation[len(done):len(done) + num_tokens]
        else:
            tokens = self._greedy(list(context_ids), num_tokens)
        return Draft(token_ids=self._corrupt(tokens))

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        pass

    def _corrupt(self, tokens: list[int]) -> list[int]:
        if self.corruption_rate == 0.0:
            return tokens
        hit = torch.rand(len(tokens), generator=self._rng) < self.corruption_rate  # [num_tokens]
        # A shift in 1..vocab-1 guarantees a different token, so a corrupted token is never accepted greedily.
        shift = torch.randint(1, self.vocab_size, (len(tokens),), generator=self._rng)  # [num_tokens]
        return [(t + int(s)) % self.vocab_size if h else t for t, h, s in zip(tokens, hit.tolist(), shift.tolist())]

    def _greedy(self, context_ids: list[int], num_tokens: int) -> list[int]:
        """The target's greedy continuation of ``context_ids``, reusing whatever prefix this drafter has cached."""
        keep = min(common_prefix_length(self._cached_ids, context_ids), len(context_ids) - 1)
        self.model.crop(keep)
        logits = self.model.forward(context_ids[keep:], num_logits=1).logits[-1]  # [vocab]
        self._cached_ids = list(context_ids)
        out: list[int] = []
        for i in range(num_tokens):
            out.append(int(logits.argmax()))
            if i + 1 < num_tokens:
                logits = self.model.forward([out[-1]], num_logits=1).logits[-1]
                self._cached_ids.append(out[-1])
        return out
