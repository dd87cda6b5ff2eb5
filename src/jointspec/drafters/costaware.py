"""Cost-aware speculation: choose each round's draft length (or no draft) from the target's cost curve.

Verifying ``k`` draft tokens means one target forward of ``k + 1`` tokens (the pending token plus the draft). What
that costs relative to one plain step depends on the backend (and the CPU) far more than on the method: a few extra
tokens may cost little more than a step in torch float32 and several steps in llama.cpp (docs/kernels.md, "Cost
curves by backend"). A draft length that pays in torch loses in llama.cpp, so the length must come from the measured
curve, not from a constant.

The model. If each draft token is accepted with probability ``a`` once the ones before it were (a chain stops at
its first rejection), a round that drafts ``k`` tokens commits on average ``E(k) = (1 - a^(k+1)) / (1 - a)`` tokens
(the accepted ones plus the token the target always adds) and costs ``T(k + 1) + k * c``, with ``T`` the target
forward cost and ``c`` the draft cost per token. Over many rounds tokens per unit cost is
``E(k) / (T(k + 1) + k * c)`` (a renewal-reward ratio); plain decoding (``k = 0``) gets ``1 / T(1)``. Each round the
wrapper picks the ``k`` in ``0 .. max`` with the highest ratio.

Worked example, prompt lookup (``c = 0``) at ``a = 0.7``, with the curves ``{1: 1, 2: 1.5, 4: 2.1, 8: 3.4, 16: 6.0}``
(llama.cpp) and ``{1: 1, 2: 1.1, 3: 1.2, 5: 1.45, 9: 1.75, 17: 2.2}`` (torch fp32), relative to one plain step::

                     k = 0   k = 1   k = 2   k = 3   k = 4   k = 5
    E(k)              1.00    1.70    2.19    2.53    2.77    2.94
    llama.cpp T(k+1)  1.00    1.50    1.80    2.10    2.43    2.75   (odd sizes interpolated)
      tokens / cost   1.00    1.13    1.22    1.21    1.14    1.07   -> k = 2: 22 % more tokens per second
    torch T(k+1)      1.00    1.10    1.20    1.33    1.45    1.53
      tokens / cost   1.00    1.55    1.83    1.91    1.91    1.93   -> k = 5 (k = 6: 3.06 / 1.60 = 1.91)

At ``a = 0.3`` llama.cpp's best draft, ``k = 1``, gives 1.3 / 1.5 = 0.87 < 1: the wrapper decodes plainly, while
torch still gains with ``k = 1`` (1.3 / 1.1 = 1.18).

Estimating ``a``. A round that drafted ``d`` tokens and had ``m`` accepted tested ``m + 1`` tokens if ``m < d`` (the
``m`` accepted ones and the first rejected one) and ``m`` if ``m = d``; the tokens after a rejection were never
tested. So the estimate is accepted tokens over *tested* tokens (the maximum-likelihood estimate of a geometric
acceptance with censoring). The naive accepted / drafted counts untested tokens as rejections and is biased low: at
``a = 0.8`` and ``d = 4`` it gives 0.59, while ``E[m] / E[tested] = a`` exactly. Both counts decay exponentially per
tested token (``memory`` = the effective number of recent tokens, 10 by default), so the estimate follows text
that changes. They
start each request from a weak prior (``prior_acceptance`` over ``prior_weight`` tokens): requests differ (chat vs.
extraction), so acceptance is per request, while the cost curve is per target and measured once.

Probing. When the best ``k`` is 0 the wrapper stops drafting, and every draft it skips is a draft it learns nothing
from. So it still drafts a short probe after 1, 2, 4, ... rounds without a draft (at most ``max_probe_interval``):
``probe_num_draft_tokens`` tokens, doubled after each probe accepted in full (a copied passage has begun: test more
of it per round, so the estimate climbs in a few rounds rather than one token at a time), back to the short probe
after any rejection. Any accepted probe token makes the next probe due in the next round. With the llama.cpp curve
a 1-token probe every 64 rounds costs 0.5 / 64 < 1 % of plain decoding. The first round of a request is a probe if
the prior alone would not draft. With a ``probe_budget`` (the batched engine sets one while a round has more than
one sequence), probes also stay far enough apart to cost at most that share of the rounds: in a full batch an extra
row costs about a row's share of the round, and probing after every accepted probe, at the half acceptance lookup
drafts get, cost more than it found. Alone, where a probe token costs a tenth of a step or less on a CPU, probes
keep the schedule above.

Shadow tests. Where a probe is dear (a full batch) and the inner drafter can say what it would draft without
changing its state (``peek``: the lookup drafters), the batched engine turns probes off and ``shadow_tests`` on: in a
round that drafts nothing the wrapper keeps the draft it skipped, and as the target commits the next tokens it scores
that draft against them, token by token, as verification would have (accepted while they agree; the first
disagreement a rejection). Verification accepts a lookup draft's token exactly when it is the target's own choice
(greedy), or with the probability the target gives it (sampling, the draft being certain), so the estimate learns
what a verified probe would have taught it, at no target cost, one round late. One such draft is pending at a time.
Peeking still costs the drafter's own lookup (tens of microseconds, against a batch row's share of a round of a
millisecond or two on a small model), so with a ``shadow_budget`` a skipped draft that disagreed is followed by the
next only after enough rounds that peeking costs at most that share of the rounds; one that agreed throughout is
followed at once, as an accepted probe is.

What learning may cost. Probes and shadow tests only tell the wrapper when drafting pays, so with a budget they
also cost at most :data:`LEARNING_SHARE_OF_GAIN` of the most a draft could gain on the round's curve (every token
accepted, :meth:`CostCurve.best_gain`). Four requests in a batch can still gain a third from a long accepted draft,
so their budgets stand; sixteen can gain a per cent or so, and their lookups would cost more than that. Where no
draft could pay at any acceptance there are no probes, with a budget or without (a full batch, or a draft model
nearly as dear as the target, such as the target as its own draft: a probe accepted in full only doubles the next),
and no shadow tests with a budget (without one they cost the target nothing).

The inner drafter. The wrapper never changes the calls the loop makes, only the budget it passes: a round it skips
still calls ``inner.propose`` with a budget of 0 (which every drafter already handles, since the loop does the same
when ``max_new_tokens`` leaves no room) and ``inner.commit`` as usual. So the inner drafter's state stays what it
would be under the plain loop: a draft model catches up on skipped tokens in its next propose, prompt lookup keeps
its own length, and an inner drafter's own empty draft (no n-gram match) is respected and counts as no test.

The draft's own cost, learned. For a draft model, ``c`` is given as the draft model's own
``measure_cost_curve(draft).cost(1)``: one call timed alone, its weights in cache. In decoding each target step evicts
them, a sampled draft also pays for its probabilities, and a draft after skipped rounds catches up on their tokens, so
a drafted token costs more than that (several times more for a trained head on the int4 target: docs/lab/benchmarks.md,
section 50), and a draft that looked as if it paid ran slower than plain decoding. So the wrapper also times its inner
drafter's ``propose`` in every round that drafts, but a request's first such round (which holds one-off work, such as
a draft model's prompt), and once :data:`DRAFT_COST_MIN_ROUNDS` rounds are timed the median of the last
:data:`DRAFT_COST_ROUNDS` rounds' seconds per drafted token replaces ``c`` wherever it is larger by more than
:data:`DRAFT_COST_MARGIN` of a plain step; never smaller than the given ``c``, so that timing noise cannot make drafting
look cheaper than it was measured. A catch-up is timed with the draft it comes with: drafting after skipped rounds
costs it. Where the learned cost is larger, probes alone also wait out their cost (as with a ``probe_budget``, capped
at :data:`LEARNING_SHARE_OF_GAIN` of the most a draft could gain): a probe after every accepted one, at the acceptance
a dear draft gets, costs what drafting does. What was learned carries over to the wrapper's next request, unless it
says that no draft could pay at all (then no probe would time a draft again, and a busy moment would keep every later
request from drafting). The learned cost is in seconds, the unit :func:`measure_cost_curve` measures in; on a curve in
other units (relative to a step, as tests give them) it stays under the margin, as it should where the units say
nothing of time.

What is not modelled: loop overhead per round (it favours drafting, since plain decoding pays it on every token, so
the choice errs towards plain decoding), and the target curve is not refined online (on a shared machine its noise
would make the choice jitter; the measured medians of :func:`measure_cost_curve` are steadier).
"""

from __future__ import annotations

import collections
import math
import random
import statistics
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from jointspec.core.draft import Draft, Drafter
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters import curve_store

# Forward sizes (draft tokens + 1) measured by default: plain, then 1, 2, 3, 4, 8 and 16 draft tokens (4 tokens
# is where the float32 CPU kernels switch, see kernels/fp32.py: the curve must not interpolate across it).
DEFAULT_SIZES = (1, 2, 3, 4, 5, 9, 17)

# Probes and shadow tests (module docstring) may cost at most this share of the most drafting could gain where they
# run (CostCurve.best_gain, every token accepted), besides their own budget: they only tell when drafting pays, and in
# a nearly full batch it pays by a per cent or so at best; where it cannot pay at all they stop.
LEARNING_SHARE_OF_GAIN = 0.25

# The draft's own cost, learned (module docstring): the median seconds per drafted token of this many recent drafted
# rounds, once at least DRAFT_COST_MIN_ROUNDS are timed.
DRAFT_COST_ROUNDS = 15
DRAFT_COST_MIN_ROUNDS = 3
# ... and only where it exceeds the given cost by more than this share of a plain step: a lookup's tens of microseconds
# change no choice, and on a curve in other units than seconds the learned cost never counts.
DRAFT_COST_MARGIN = 0.05

# Tokens a shadow test scores at most (module docstring): one such draft is pending at a time, and a plain round
# commits one token, so longer ones would only test further along the same draft.
SHADOW_LENGTH = 4


@dataclass(frozen=True)
class CostCurve:
    """The cost of one target forward of ``n`` tokens, by ``n``, and the draft cost per drafted token.

    Any unit (seconds, or relative to ``n = 1``) as long as both costs use the same one. Between measured sizes the
    cost is interpolated linearly, past the largest one extrapolated along the last segment. A forward of more tokens
    does all the work of a shorter one and more, so the curve is read through its running maximum: a measured dip
    (timing noise) never makes a longer draft look cheaper than a shorter one.
    """

    target_cost: Mapping[int, float]  # num_inputs -> cost of one forward of that many tokens
    draft_cost_per_token: float = 0.0

    def __post_init__(self) -> None:
        sizes = sorted(self.target_cost)
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
            raise ValueError(f"CostCurve sizes must be integers >= 1, got {sizes}")
        if len(sizes) < 2 or sizes[0] != 1:
            raise ValueError(f"CostCurve needs the cost of a 1-token forward (plain decoding) and at least one "
                             f"larger size, got sizes {sizes}")
        bad = {n: c for n, c in self.target_cost.items() if not (math.isfinite(c) and c > 0)}
        if bad:
            raise ValueError(f"CostCurve costs must be finite and > 0, got {bad}")
        if not (math.isfinite(self.draft_cost_per_token) and self.draft_cost_per_token >= 0):
            raise ValueError(f"draft_cost_per_token must be finite and >= 0, got {self.draft_cost_per_token}")
        # A sorted private copy: the caller's mapping may change later, the curve must not.
        object.__setattr__(self, "target_cost", {n: float(self.target_cost[n]) for n in sizes})
        # The running maximum, computed once: cost() runs for every candidate length of every round of every row.
        envelope = list(self.target_cost.values())
        for i in range(1, len(envelope)):
            envelope[i] = max(envelope[i], envelope[i - 1])
        object.__setattr__(self, "_envelope", tuple(envelope))
        # cost() by whole sizes, filled as asked: a batched engine asks for each candidate length of every row's round.
        object.__setattr__(self, "_by_size", {})
        object.__setattr__(self, "_best_gain", {})

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.target_cost)

    def cost(self, num_inputs: float) -> float:
        """Cost of one target forward of ``num_inputs`` tokens (``>= 1``)."""
        known = self._by_size.get(num_inputs)
        if known is not None:
            return known
        if num_inputs < 1:
            raise ValueError(f"a target forward has at least 1 token, got {num_inputs}")
        sizes, envelope = self.sizes, self._envelope
        i = next((i for i, n in enumerate(sizes) if n >= num_inputs), len(sizes) - 1)
        i = max(i, 1)
        low, high = sizes[i - 1], sizes[i]
        cost = envelope[i - 1] + (envelope[i] - envelope[i - 1]) * (num_inputs - low) / (high - low)
        if type(num_inputs) is int:
            self._by_size[num_inputs] = cost
        return cost

    def round_cost(self, num_draft_tokens: int) -> float:
        """Cost of a round that drafts ``num_draft_tokens`` tokens and verifies them with the pending token."""
        return self.cost(num_draft_tokens + 1) + num_draft_tokens * self.draft_cost_per_token

    def best_gain(self, max_num_draft_tokens: int) -> float:
        """The most any chain of up to ``max_num_draft_tokens`` tokens can gain over plain decoding on this curve:
        ``max_k (k + 1) * round_cost(0) / round_cost(k) - 1``, every token accepted. At or under 0 no draft pays
        whatever its acceptance (in a full batch, where an extra row costs a row's share of the round)."""
        known = self._best_gain.get(max_num_draft_tokens)
        if known is None:
            plain = self.round_cost(0)
            known = max(((k + 1) * plain / self.round_cost(k) - 1.0 for k in range(1, max_num_draft_tokens + 1)),
                        default=0.0)
            self._best_gain[max_num_draft_tokens] = known
        return known

    def relative(self) -> CostCurve:
        """The same curve in units of one plain step (``cost(1) = 1``)."""
        unit = self.target_cost[1]
        return CostCurve({n: c / unit for n, c in self.target_cost.items()}, self.draft_cost_per_token / unit)

    def with_draft_cost(self, draft_cost_per_token: float) -> CostCurve:
        return replace(self, draft_cost_per_token=draft_cost_per_token)

    def to_dict(self) -> dict:
        return {"target_cost": {str(n): c for n, c in self.target_cost.items()},
                "draft_cost_per_token": self.draft_cost_per_token}


def expected_tokens(acceptance: float, num_draft_tokens: int) -> float:
    """Mean tokens committed by a round of ``num_draft_tokens`` chain tokens, each accepted with ``acceptance``
    once its predecessors were: 1 + a + ... + a^k."""
    if acceptance >= 1.0:
        return num_draft_tokens + 1.0
    return (1.0 - acceptance ** (num_draft_tokens + 1)) / (1.0 - acceptance)


def choose_num_draft_tokens(acceptance: float, curve: CostCurve, max_num_draft_tokens: int,
                            min_gain: float = 0.0) -> int:
    """The draft length in ``0 .. max_num_draft_tokens`` with the most expected tokens per unit cost.

    A draft must beat plain decoding by a factor ``1 + min_gain`` to be chosen; among equal rates the shorter draft
    wins (less work thrown away when the estimate is off).
    """
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if max_num_draft_tokens < 0:
        raise ValueError(f"max_num_draft_tokens must be >= 0, got {max_num_draft_tokens}")
    best_k, best_rate = 0, (1.0 + min_gain) / curve.round_cost(0)
    # No draft commits 1 / (1 - a) tokens or more, and round costs never fall with k, so once that over the next
    # round's cost is no better than the best, no longer draft can be (a batched engine asks every row every round).
    most = 1.0 / (1.0 - acceptance) if acceptance < 1.0 else math.inf
    for k in range(1, max_num_draft_tokens + 1):
        cost = curve.round_cost(k)
        if most / cost <= best_rate:
            break
        rate = expected_tokens(acceptance, k) / cost
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


# measure_cost_curve's results, per weights object (see _memo_owner) and settings.
_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _memo_owner(target) -> object:
    """What a measured curve belongs to: the weights (``target.model``) where the adapter forks over shared weights, so
    adapters sharing one model (a self-draft, the oracle) share one measurement; an adapter's ``cost_owner`` where it
    names one (heads bound per request from one template, drafts/artifact.py); else the adapter itself."""
    if target.capabilities.fork:
        return target.model
    owner = getattr(target, "cost_owner", None)
    return target if owner is None else owner


def _synchronize(device) -> None:
    # Queued GPU work must finish before a timer reads, or it measures the launch.
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure_cost_curve(target, *, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 7, context_tokens: int = 128,
                       seed: int = 0, refresh: bool = False, argmax_only: bool | None = None) -> CostCurve:
    """Time target forwards of each of ``sizes`` tokens after a ``context_tokens``-token context; medians, seconds.

    ``target`` is any adapter with the CausalLM interface (``forward(token_ids, num_logits=None)``, ``crop``,
    ``num_cached``, ``max_context``): the torch adapter, a quantised model or a llama.cpp adapter alike. The
    measurement runs *after* whatever the adapter has cached, on random tokens (their values do not change a
    forward's cost), and crops back to the original length at the end, so the adapter's cache is left as it was:
    the measured context is ``num_cached + context_tokens`` tokens. Each size is run once untimed (warm-up), then
    ``repeats`` times with sizes shuffled within each pass, so drift in machine speed hits every size alike. Every
    forward returns all rows of logits, as verification does; a target that reads greedy argmaxes through a cheaper
    head (``capabilities.argmax_screen``) is timed so, as greedy decoding (the default) runs it, unless
    ``argmax_only`` is False: then with its exact head, as sampled verification runs it (every row's logits).

    The result is memoised per model (``target.model`` where the adapter has one, else the adapter), settings and
    torch thread count: a server or benchmark pays for it once. Inside
    :func:`~jointspec.drafters.curve_store.persisted_curves` (``jointspec generate``) it is also kept on disk for the
    next process that loads the same model with the same options. ``refresh=True`` measures again.
    """
    sizes = tuple(sorted(set(sizes)))
    if not sizes or sizes[0] != 1 or any(not isinstance(n, int) for n in sizes) or len(sizes) < 2:
        raise ValueError(f"sizes must be integers including 1 and at least one larger size, got {sizes}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if context_tokens < 0:
        raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
    owner = _memo_owner(target)
    from jointspec.kernels.fp32 import attention_in_use, kernels_in_use

    # The kernels are part of the key: stock_kernels() can switch a model's linears and attention for a while.
    screened = target.capabilities.argmax_screen and argmax_only is not False
    forward_options = {"argmax_only": True} if screened else {}
    key = (sizes, repeats, context_tokens, seed, torch.get_num_threads(), kernels_in_use(owner),
           attention_in_use(owner), screened)
    try:
        memo = _MEASURED.setdefault(owner, {})
    except TypeError:  # an owner that cannot be weakly referenced: measure every time
        memo = {}
    if key in memo and not refresh:
        return memo[key]
    stored = curve_store.entry_path(getattr(owner, "jointspec_identity", None),
                                    (*key, getattr(target, "kv_dtype", None), target.device))
    kept = None if refresh else curve_store.read(stored)
    if kept is not None and set(kept) == set(sizes):
        memo[key] = CostCurve(kept)
        return memo[key]

    start = target.num_cached
    room = int(target.max_context) - start - sizes[-1]
    if room < 0:
        raise ValueError(f"cannot measure a {sizes[-1]}-token forward: the adapter holds {start} cached tokens and "
                         f"its context is {target.max_context}; measure on a reset adapter or pass smaller sizes")
    context = min(context_tokens, room)
    rng = random.Random(seed)
    vocab = target.vocab_size
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    device = target.device
    try:
        if context:
            target.forward([rng.randrange(vocab) for _ in range(context)], num_logits=0)
        for timed in [False] + [True] * repeats:
            order = list(sizes)
            rng.shuffle(order)
            for n in order:
                tokens = [rng.randrange(vocab) for _ in range(n)]
                _synchronize(device)
                t0 = time.perf_counter()
                target.forward(tokens, **forward_options)
                _synchronize(device)
                elapsed = time.perf_counter() - t0
                # A feature-fed draft head may keep fewer entries than asked (it drops those fed with guesses).
                target.crop(min(start + context, target.num_cached))
                if timed:
                    samples[n].append(elapsed)
    finally:
        target.crop(min(start, target.num_cached))
    curve = CostCurve({n: statistics.median(s) for n, s in samples.items()})
    memo[key] = curve
    curve_store.write(stored, curve.target_cost)
    return curve


@dataclass
class _RequestState:
    """What the wrapper learns during one request (reset by ``start``)."""

    accepted: float  # exponentially decayed accepted draft tokens
    tested: float  # exponentially decayed tested draft tokens (accepted + first rejected)
    rounds_without_draft: int = 0
    probe_interval: int = 1
    probe_length: int = 1
    num_drafted: int = 0  # tokens in the draft handed to the loop this round
    probing: bool = False
    shadow: tuple[int, ...] = ()  # a skipped draft not yet scored in full (shadow tests)
    shadow_at: int = 0  # the context position its first token stands for
    shadow_wait: int = 0  # rounds to pass before the next shadow test (shadow_budget)
    peek_seconds: float = 0.0  # what the last peek took
    drafted_before: bool = False  # a round of this request drafted (the first such round holds one-off work)


class CostAwareDrafter:
    """Wraps a chain drafter; each round drafts the length with the most expected tokens per unit cost, or nothing.

    ``max_num_draft_tokens`` bounds the chosen length (the inner drafter may draft fewer: its own limit, no n-gram
    match). ``memory`` is how many recent tested tokens the acceptance estimate effectively averages. See the module
    docstring for the model, the estimator and the probing schedule.
    """

    cost_aware = True  # methods.build_method does not wrap it again
    clock = staticmethod(time.perf_counter)  # what drafted rounds are timed by (a test gives its own)

    def __init__(self, inner: Drafter, curve: CostCurve, *, max_num_draft_tokens: int = 16,
                 prior_acceptance: float = 0.5, prior_weight: float = 2.0, memory: float = 10.0,
                 probe_num_draft_tokens: int = 1, max_probe_interval: int = 64, min_gain: float = 0.0,
                 min_num_draft_tokens: int = 0, probe_budget: float | None = None,
                 shadow_tests: bool = False, shadow_budget: float | None = None) -> None:
        if max_num_draft_tokens < 1:
            raise ValueError(f"max_num_draft_tokens must be >= 1, got {max_num_draft_tokens}")
        if not 0 <= min_num_draft_tokens <= max_num_draft_tokens:
            raise ValueError(f"min_num_draft_tokens must be in 0..max_num_draft_tokens ({max_num_draft_tokens}), "
                             f"got {min_num_draft_tokens}")
        if not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {prior_acceptance}")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0 (pseudo-tokens behind the prior), got {prior_weight}")
        if not memory > 1:
            raise ValueError(f"memory must be > 1 (tested tokens the estimate averages), got {memory}")
        if not 1 <= probe_num_draft_tokens <= max_num_draft_tokens:
            raise ValueError(f"probe_num_draft_tokens must be in 1..max_num_draft_tokens ({max_num_draft_tokens}), "
                             f"got {probe_num_draft_tokens}")
        if max_probe_interval < 1:
            raise ValueError(f"max_probe_interval must be >= 1, got {max_probe_interval}")
        if not min_gain >= 0:
            raise ValueError(f"min_gain must be >= 0, got {min_gain}")
        if shadow_budget is not None and not 0 < shadow_budget <= 1:
            raise ValueError(f"shadow_budget must be None or in (0, 1] (the share of decoding time peeking may cost), "
                             f"got {shadow_budget}")
        if probe_budget is not None and not 0 < probe_budget <= 1:
            raise ValueError(f"probe_budget must be None or in (0, 1] (the share of decoding time probes may cost), "
                             f"got {probe_budget}")
        self.inner = inner
        self.curve = curve
        self.max_num_draft_tokens = max_num_draft_tokens
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.decay = 1.0 - 1.0 / memory
        self.probe_num_draft_tokens = probe_num_draft_tokens
        self.max_probe_interval = max_probe_interval
        self.min_gain = min_gain
        self.probe_budget = probe_budget
        # Score skipped drafts against the target's tokens instead of probing (module docstring), where the inner
        # drafter can peek.
        self.shadow_tests = shadow_tests
        self.shadow_budget = shadow_budget
        # A method whose output law is its point (MTAD) never decodes a round plainly: it drafts at least this many.
        self.min_num_draft_tokens = min_num_draft_tokens
        self._state = self._fresh_state()
        # Seconds per drafted token of recent drafted rounds, across requests (the draft's cost is the machine's).
        self._draft_seconds: collections.deque[float] = collections.deque(maxlen=DRAFT_COST_ROUNDS)
        # Seconds of the next round's draft spent before propose, by someone else: a batched engine's head call made
        # for many requests at once (batch/lockstep.py), this request's share. Timed as drafting, then cleared.
        self.outside_seconds = 0.0
        self._priced: tuple[CostCurve | None, float, CostCurve | None] = (None, 0.0, None)

    @property
    def curve(self) -> CostCurve:
        """The target's cost curve the draft length is chosen on (a batched engine replaces it as the batch
        changes). An inner drafter with ``price_rows`` (corpus lookup) is told what one drafted row then costs, as
        a fraction of a plain round."""
        return self._curve

    @curve.setter
    def curve(self, curve: CostCurve) -> None:
        self._curve = curve
        price_rows = getattr(self.inner, "price_rows", None)
        if price_rows is not None:
            price_rows(max(0.0, curve.round_cost(1) / curve.round_cost(0) - 1.0))

    @property
    def learned_draft_cost(self) -> float | None:
        """The drafted rounds' median seconds per drafted token (None until DRAFT_COST_MIN_ROUNDS are timed)."""
        if len(self._draft_seconds) < DRAFT_COST_MIN_ROUNDS:
            return None
        return statistics.median(self._draft_seconds)

    @property
    def priced_curve(self) -> CostCurve:
        """``curve`` with its draft cost per token raised to the learned one where that is larger (module
        docstring, "The draft's own cost, learned"): what each round's length is chosen on."""
        curve, learned = self._curve, self.learned_draft_cost
        if learned is None or learned - curve.draft_cost_per_token <= DRAFT_COST_MARGIN * curve.round_cost(0):
            return curve
        priced_for, priced_at, priced = self._priced
        if priced_for is not curve or priced_at != learned:
            priced = curve.with_draft_cost(learned)
            self._priced = (curve, learned, priced)
        return priced

    @property
    def warm_per_prompt(self) -> bool:
        # The benchmark asks the drafter whether a prompt's first run is a warm-up (the oracle's is).
        return bool(getattr(self.inner, "warm_per_prompt", False))

    @property
    def acceptance(self) -> float:
        """The current per-token acceptance estimate."""
        # accepted <= tested always; min() only guards the last bit of rounding.
        return min(1.0, self._state.accepted / self._state.tested)

    def _fresh_state(self) -> _RequestState:
        # rounds_without_draft = 0 with probe_interval = 1: the first round probes if the prior would not draft.
        return _RequestState(accepted=self.prior_acceptance * self.prior_weight, tested=self.prior_weight,
                             probe_length=self.probe_num_draft_tokens)

    def start(self, prompt_ids: list[int]) -> None:
        self._state = self._fresh_state()
        # A cost learned on earlier requests stands (the draft's cost is the machine's), unless it says that no draft
        # could pay at all: then nothing would time a draft again, and one busy moment would keep every later request
        # from drafting.
        if self.priced_curve.best_gain(self.max_num_draft_tokens) <= self.min_gain < self._curve.best_gain(
                self.max_num_draft_tokens):
            self._draft_seconds.clear()
        self.inner.start(prompt_ids)

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        state = self._state
        self._score_shadow(context_ids)
        limit = min(self.max_num_draft_tokens, max_num_draft_tokens)
        num_tokens = choose_num_draft_tokens(self.acceptance, self.priced_curve, max(limit, 0), self.min_gain)
        num_tokens = max(num_tokens, min(self.min_num_draft_tokens, max(limit, 0)))
        shadowing = self.shadow_tests and hasattr(self.inner, "peek")
        # A probe is the probe_interval-th round since the last draft: interval 1 probes in consecutive rounds. Where
        # a probe costs much next to a round (a full batch), it also waits out its share of probe_budget; with shadow
        # tests there are none.
        probe_length = min(state.probe_length, limit)
        state.probing = (not shadowing and num_tokens == 0 and limit > 0 and state.rounds_without_draft + 1
                         >= max(state.probe_interval, self._probe_spacing(probe_length)))
        if state.probing:
            num_tokens = probe_length
        if num_tokens:
            state.shadow = ()  # a verified draft tests these positions itself
        elif shadowing and not state.shadow and limit > 0:
            if state.shadow_wait:
                state.shadow_wait -= 1
            elif self._learning_budget(self.shadow_budget) != 0:
                start = time.perf_counter()
                state.shadow = tuple(self.inner.peek(context_ids, min(limit, SHADOW_LENGTH)))
                state.peek_seconds = time.perf_counter() - start
                state.shadow_at = len(context_ids)
                if not state.shadow:  # nothing to draft here (no match): the lookup cost all the same
                    state.shadow_wait = self._shadow_spacing()
        # A skipped round still calls the inner drafter, with no budget: its state then stays what the plain loop
        # would leave (see the module docstring).
        # Every drafted round is timed but a request's first (module docstring), catch-up after skipped rounds
        # included: drafting then costs that too.
        timed = state.drafted_before
        start = self.clock()
        draft = self.inner.propose(context_ids, num_tokens, sampling, generator)
        seconds = self.clock() - start + self.outside_seconds
        self.outside_seconds = 0.0
        if draft.num_nodes and timed:
            self._draft_seconds.append(seconds / draft.num_nodes)
        state.drafted_before = state.drafted_before or draft.num_nodes > 0
        if not draft.is_chain:
            raise UnsupportedOptionError(
                f"cost-aware speculation needs a chain drafter, but {type(self.inner).__name__} proposed a tree; "
                "use the method without cost-aware speculation")
        assert draft.num_nodes <= num_tokens, "the inner drafter exceeded its draft budget"
        state.num_drafted = draft.num_nodes
        if draft.num_nodes:
            state.rounds_without_draft = 0
            if not state.probing:
                # Drafting paid until now: if it stops paying, probe again soon, and short.
                state.probe_interval = 1
                state.probe_length = self.probe_num_draft_tokens
        else:
            state.rounds_without_draft += 1
            state.probing = False  # no draft (e.g. no n-gram match): the probe is still due
        return draft

    def _score_shadow(self, context_ids: list[int]) -> None:
        """Score the pending skipped draft against the tokens committed since it was made: each agreeing token
        accepted, the first that disagrees rejected (and the draft done), as verification would have counted them."""
        state = self._state
        if not state.shadow:
            return
        committed = context_ids[state.shadow_at: state.shadow_at + len(state.shadow)]
        agreed = 0
        while agreed < len(committed) and committed[agreed] == state.shadow[agreed]:
            agreed += 1
        if agreed < len(committed):  # a disagreement: tested up to it
            self._observe(agreed, agreed + 1)
            state.shadow = ()
            state.shadow_wait = self._shadow_spacing()
            return
        self._observe(agreed, agreed)
        state.shadow = state.shadow[agreed:]
        state.shadow_at += agreed

    def _shadow_spacing(self) -> int:
        """Rounds to pass after a disagreeing shadow test so that peeking costs at most ``shadow_budget`` of the
        rounds' time (the curve in seconds, as measured; 0 without a budget)."""
        budget = self._learning_budget(self.shadow_budget)
        if not budget:  # none set, or no draft pays here (then no peek is made until one can)
            return 0
        share = self.curve.round_cost(0)
        return max(0, math.ceil(self._state.peek_seconds / (budget * share)) - 1)

    def _learning_budget(self, budget: float | None) -> float | None:
        """``budget`` (the share of the rounds' time probes or shadow tests may cost) capped at
        :data:`LEARNING_SHARE_OF_GAIN` of the most a draft could gain on the current curve; 0 where no draft can
        pay (it could never be chosen, so nothing is worth learning); None without a budget."""
        if budget is None:
            return None
        gain = self.priced_curve.best_gain(self.max_num_draft_tokens)
        return 0.0 if gain <= self.min_gain else min(budget, LEARNING_SHARE_OF_GAIN * gain)

    def _observe(self, accepted: int, tested: int) -> None:
        """Fold ``accepted`` of ``tested`` draft tokens into the decayed estimate."""
        state = self._state
        weight = self.decay ** tested
        state.accepted = state.accepted * weight + accepted
        state.tested = state.tested * weight + tested

    def _probe_spacing(self, length: int) -> float:
        """The fewest rounds a probe of ``length`` tokens must come after the last draft so that probes cost at
        most ``probe_budget`` of the rounds' (1 without a budget, or where a draft token costs little; inf where no
        draft can pay)."""
        if length < 1:
            return 1
        # No draft pays here, with a budget or without: no probe until one can (a probe of a draft as dear as the
        # target costs more than a step, and one accepted in full only doubles the next).
        curve = self.priced_curve
        if curve.best_gain(self.max_num_draft_tokens) <= self.min_gain:
            return math.inf
        if self.probe_budget is None:
            # Alone a probe follows every accepted one (it costs a tenth of a step or so), unless the draft has been
            # timed dearer than its measured cost: then probing so often costs what drafting does, and probes wait
            # until they cost at most their share of the most a draft could gain here.
            if curve is self._curve:
                return 1
            budget = self._learning_budget(1.0)
        else:
            budget = self._learning_budget(self.probe_budget)
        base = curve.round_cost(0)
        extra = curve.round_cost(length) - base
        return max(1, math.ceil(extra / (budget * base) - 1e-9))

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        state = self._state
        drafted = state.num_drafted
        assert 0 <= num_accepted <= drafted, f"{num_accepted} accepted of {drafted} drafted"
        if drafted:
            self._observe(num_accepted, num_accepted + (1 if num_accepted < drafted else 0))
            if state.probing:
                state.probe_interval = 1 if num_accepted else min(2 * state.probe_interval, self.max_probe_interval)
                state.probe_length = (min(2 * state.probe_length, self.max_num_draft_tokens)
                                      if num_accepted == drafted else self.probe_num_draft_tokens)
        state.num_drafted = 0
        state.probing = False
        self.inner.commit(context_ids, num_accepted)
