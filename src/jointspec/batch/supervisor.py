"""Drafts held off where the engine's own rounds measure faster without them.

Load-aware drafting (:mod:`jointspec.batch.lockstep`) prices each round's drafts on a cost curve measured once, at
start-up, and on acceptance estimates; both are models. On a shared or throttled machine the curve drifts from the
forwards it priced (a 2-core VM's speed moved by a quarter within minutes), and a model that errs by a few per cent
of a round puts a full batch's drafts behind plain decoding, which is what speculative decoding under load is known
for. So the engine also measures the thing itself: at each batch size it runs some rounds with the rows' drafts held
off (each drafter given no budget, as the loop gives it when ``max_new_tokens`` leaves no room) and compares the
tokens a second its rounds commit with drafts and without. Where rounds without drafts measure faster by more than
:data:`MARGIN`, drafts stay off at that size but for one round in :data:`EXPLORE_EVERY`; elsewhere drafts run as
their drafters choose and one round in :data:`EXPLORE_EVERY` runs without. Until both kinds of round have
:data:`MIN_ROUNDS` at a size, the two alternate.

The comparison is of interleaved rounds of one process, so a machine that slows slows both. Each kind's tokens and
seconds decay by ``1 - 1 / memory`` every round at its size, so the rarer kind's rate is of its recent rounds, and a
change of workload (a run of extraction requests, whose drafts pay many times over) shows within tens of rounds.

A request alone is not supervised: it drafts as ``generate`` drafts, on its own curve, measured as ``generate``
measures it. Holding drafts off never changes what is generated: the engine supervises only batches of greedy rows
of lossless methods, whose rows commit exactly the tokens they would have (never MTAD's, whose output law is its
drafts, nor a sampled row's: the server repeats a seed's text). And only rows whose load-aware drafts are lookups
(``default`` where it drafts by lookup, cost-aware ``pld`` and ``corpus``, ``lookahead``, ``lade``, ``aded``): a draft
model or head skips its own forwards in a held-off round and catches up in its next draft, which would be measured
against drafting. What it costs: where drafts pay, one round in :data:`EXPLORE_EVERY` without them (at
a 1.2x gain from drafts, about 1 % of the tokens), and the warm-up's alternation at each batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_ROUNDS = 8  # rounds of each kind at a batch size before either is preferred
EXPLORE_EVERY = 16  # one round in this many runs the kind not preferred
MARGIN = 0.02  # rounds without drafts must commit this share more tokens a second before drafts stay off
MEMORY = 128  # rounds at a batch size over which the measured rates effectively average


@dataclass
class _Rate:
    """Decayed tokens and seconds of one kind of round at one batch size."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Size:
    drafted: _Rate = field(default_factory=_Rate)
    held: _Rate = field(default_factory=_Rate)
    count: int = 0  # rounds decided at this size


class DraftSupervisor:
    """Decides, each round, whether a batch of a given size drafts, from the rounds measured so far (module
    docstring). ``key``: the batch's size, or anything that tells apart batches whose rounds cost differently."""

    def __init__(self, *, min_rounds: int = MIN_ROUNDS, explore_every: int = EXPLORE_EVERY, margin: float = MARGIN,
                 memory: float = MEMORY) -> None:
        if min_rounds < 1:
            raise ValueError(f"min_rounds must be >= 1, got {min_rounds}")
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {explore_every}")
        if not margin >= 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if not memory > 1:
            raise ValueError(f"memory must be > 1 (rounds the rates average), got {memory}")
        self.min_rounds = min_rounds
        self.explore_every = explore_every
        self.margin = margin
        self.decay = 1.0 - 1.0 / memory
        self._sizes: dict[object, _Size] = {}

    def drafts(self, key: object) -> bool:
        """Whether this round's rows may draft (True) or are held off (False)."""
        size = self._sizes.setdefault(key, _Size())
        count = size.count
        size.count += 1
        if not self._measured(size):
            return count % 2 == 0
        explore = count % self.explore_every == self.explore_every - 1
        return self.prefers_drafts(key) != explore

    def prefers_drafts(self, key: object) -> bool:
        """Whether rounds with drafts are preferred at ``key`` (so far; True before anything is measured)."""
        size = self._sizes.get(key)
        if size is None or not self._measured(size):
            return True
        return size.held.per_second <= size.drafted.per_second * (1.0 + self.margin)

    def _measured(self, size: _Size) -> bool:
        return min(size.drafted.rounds, size.held.rounds) >= self.min_rounds

    def record(self, key: object, drafted: bool, tokens: int, seconds: float) -> None:
        """A round at ``key`` (drafts run or held off) committed ``tokens`` in ``seconds``."""
        size = self._sizes.setdefault(key, _Size())
        for rate in (size.drafted, size.held):
            rate.tokens *= self.decay
            rate.seconds *= self.decay
        rate = size.drafted if drafted else size.held
        rate.tokens += tokens
        rate.seconds += seconds
        rate.rounds += 1

    def rates(self) -> dict[object, tuple[float, float]]:
        """Tokens a second with drafts and without, by key: what a benchmark reports beside its rounds."""
        return {key: (size.drafted.per_second, size.held.per_second) for key, size in self._sizes.items()}
