"""The decode loop: one loop for every method.

Each round:
1. the drafter proposes up to ``max_num_draft_tokens`` tokens (a chain or a tree); the budget is clipped so that a
   round can never emit past ``max_new_tokens`` or the model's context;
2. the target scores the pending token (the last committed one, not yet in its cache) and every draft node in one
   forward pass, giving ``num_nodes + 1`` rows of logits, so even a rejected or empty draft yields a token;
3. the verifier decides which draft nodes to keep and the one token that follows them;
4. the loop commits: it cuts the new tokens after the first end-of-sequence token (plain decoding would have stopped
   there), keeps in the target cache exactly the committed tokens but the new pending one, and tells the drafter.

The target cache invariant: it holds every committed token except the last. Prefill therefore feeds the prompt
minus its last token, and the ``ar`` baseline is this same loop with a drafter that proposes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from jointspec.core.draft import Draft, Drafter, row_paths, tree_depths
from jointspec.core.errors import ContextTooLongError, UnsupportedOptionError
from jointspec.core.grammar import Grammar, GrammarState, masked_logits
from jointspec.core.logprobs import TokenLogprob, check_top_logprobs, token_logprobs
from jointspec.core.penalties import NO_PENALTIES, Penalties, penalized_rows
from jointspec.core.sampling import RowDraws, SamplingConfig, draws_for, position_key, sequence_draw_key
from jointspec.core.target import ForwardCall, ForwardOutput, TargetLM
from jointspec.core.verdict import Verifier


def committed_tokens(token_ids: list[int], eos_token_ids: frozenset[int]) -> tuple[list[int], bool]:
    """What a round commits of a verdict's tokens: all of them, or those up to and including the first
    end-of-sequence token (plain decoding would have stopped there), and whether it stopped so. Shared by this loop
    and the batched engine, which must commit the same tokens."""
    cut = next((i + 1 for i, token in enumerate(token_ids) if token in eos_token_ids), None)
    return (token_ids, False) if cut is None else (token_ids[:cut], True)


def kept_draft_tokens(num_accepted: int, new_tokens: list[int]) -> int:
    """The accepted draft tokens that the statistics count for a round: all of them, unless an end-of-sequence token
    among them ended the round early. That token then counts as the round's one token of its own (as the target's
    token does otherwise) and the accepted tokens after it, never committed, not at all; so a round commits
    ``1 + kept`` tokens either way, as "tokens per round = 1 + accepted / rounds" says."""
    return min(num_accepted, len(new_tokens) - 1)


def verified_logits(logits: torch.Tensor, draft: Draft, tokens: list[int], prompt_length: int, config: DecodeConfig,
                    masks) -> torch.Tensor:
    """The rows a verifier reads from a round's forward ``logits`` (the pending token's row, then one a draft node):
    each penalised by the text before it, committed ``tokens`` and then its draft path (core/penalties.py), then
    masked by the grammar's ``masks`` where there are any (core/grammar.py)."""
    if config.penalties.active:
        logits = penalized_rows(logits, tokens, prompt_length, row_paths(draft), config.penalties)
    if masks is not None:
        logits = masked_logits(logits, masks)
    return logits


def committed_rows(accepted: list[int], new_tokens: list[int]) -> list[int]:
    """The rows of a round's forward that its committed tokens follow (core/logprobs.py): token ``i`` follows row 0,
    and each later one the row after the accepted draft node before it."""
    return ([0] + [1 + node for node in accepted])[:len(new_tokens)]


@dataclass
class SpecStats:
    """Counters for one generation. Positions are draft depths (0 = first draft token)."""

    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_forced_tokens: int = 0  # of the accepted, the tokens a grammar forced (structured output), not a drafter's
    num_new_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    prompt_tokens_reused: int = 0  # prompt tokens whose cache entries a batched engine took from an earlier request

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per target call: 1 + accepted / rounds (1.0 for plain decoding)."""
        return 1.0 + self.num_accepted_tokens / self.num_rounds if self.num_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def record(self, depths: list[int], num_accepted: int, num_new_tokens: int = 0, num_forced: int = 0) -> None:
        """One round: a draft with nodes at ``depths``, ``num_accepted`` of them kept (``num_forced`` of those a
        grammar's forced tokens), ``num_new_tokens`` committed."""
        self.num_rounds += 1
        self.num_new_tokens += num_new_tokens
        self.num_draft_tokens += len(depths)
        self.num_accepted_tokens += num_accepted
        self.num_forced_tokens += num_forced
        deepest = max(depths, default=-1) + 1
        for counts in (self.drafted_per_position, self.accepted_per_position):
            counts.extend([0] * (deepest - len(counts)))
        for depth in range(deepest):
            self.drafted_per_position[depth] += 1
        for depth in range(num_accepted):
            self.accepted_per_position[depth] += 1

    def copy(self) -> SpecStats:
        return replace(self, drafted_per_position=list(self.drafted_per_position),
                                   accepted_per_position=list(self.accepted_per_position))

    def merge(self, other: SpecStats) -> None:
        for name in ("num_rounds", "num_draft_tokens", "num_accepted_tokens", "num_forced_tokens", "num_new_tokens",
                     "draft_seconds", "verify_seconds", "prefill_seconds", "prompt_tokens_reused"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("drafted_per_position", "accepted_per_position"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, value in enumerate(theirs):
                mine[i] += value

    def to_dict(self) -> dict:
        return {
            "num_rounds": self.num_rounds,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_forced_tokens": self.num_forced_tokens,
            "num_new_tokens": self.num_new_tokens,
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position],
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "prompt_tokens_reused": self.prompt_tokens_reused,
        }


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    eos_token_ids: frozenset[int] = frozenset()
    grammar: Grammar | None = None  # structured output: what every answer must match (core/grammar.py)
    # Each committed token's log-probability under the target, with this many of its row's most likely tokens
    # (core/logprobs.py); None: none computed.
    logprobs: int | None = None
    # Repetition, presence and frequency penalties on every row (core/penalties.py); neutral by default.
    penalties: Penalties = NO_PENALTIES

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_top_logprobs(self.logprobs)
        if self.grammar is not None and self.grammar.eos_token_ids != self.eos_token_ids:
            # The grammar allows its end-of-sequence tokens where the answer may end, and only those once it is
            # complete: the decoding must stop at exactly those.
            raise ValueError(f"the grammar was compiled with end-of-sequence ids {sorted(self.grammar.eos_token_ids)} "
                             f"and the decoding stops at {sorted(self.eos_token_ids)}: compile it with the same ids")


@dataclass
class DecodeState:
    """One sequence between rounds: its tokens (prompt and committed), where it must stop, and the round in flight."""

    tokens: list[int]
    end: int  # the sequence stops growing at this length (max_new_tokens or the context)
    config: DecodeConfig
    generator: torch.Generator | None
    argmax_only: bool  # greedy verification may read the target's screened argmax
    max_verify_rows: int | None = None  # the target's, read once (TargetCapabilities)
    top_k_only: int = 0  # sampled verification with top-k may read the target's screened top k (k; 0: every logit)
    draws: bool = False  # temperature alone: rows of drafts without probabilities are drawn through the screen
    draw_key: int | None = None  # the sequence's noise key, drawn from its generator at its first such round
    grammar: GrammarState | None = None  # structured output: where the answer stands in its grammar
    masks: torch.Tensor | None = None  # the round in flight's allowed tokens per row (grammar only)
    own_nodes: int = 0  # the round's draft nodes that are the drafter's (not tokens a grammar forced)
    proposed: Draft | None = None  # the drafter's own draft, where a grammar changed it (core/grammar.py)
    kept: list[int] = field(default_factory=list)  # its nodes the round verifies, by their index in it
    done: bool = False
    stopped: bool = False  # it ended on an end-of-sequence token
    draft: Draft | None = None  # the round in flight's draft, between begin_round and finish_round
    depths: list[int] = field(default_factory=list)
    num_accepted: int = 0  # the last round's
    num_forced: int = 0  # the last round's accepted tokens that a grammar forced (they follow the drafter's own)
    draft_seconds: float = 0.0
    verify_start: float = 0.0
    # Where the config asks for log-probabilities: whether the round in flight's forward reads a screened head, so
    # that the committed rows' exact logits come from their hidden states (core/logprobs.py); and the last round's
    # figures, one per token it committed.
    logprob_hidden: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_length: int = 0  # the tokens before the answer (what the presence and frequency penalties leave out)
    # A deferred round's committed rows' hidden states and tokens (finish_round(defer_logprobs=True)); None: none.
    pending_logprobs: tuple[torch.Tensor, list[int]] | None = None


class SpeculativeDecoder:
    """Runs rounds of draft -> verify -> commit for one sequence at a time."""

    def __init__(self, target: TargetLM, drafter: Drafter, verifier: Verifier) -> None:
        self.target = target
        self.drafter = drafter
        self.verifier = verifier
        self.stats = SpecStats()
        # Every committed token's log-probability so far, where the config asks for them (like ``stats``, the
        # generation's: it starts afresh with each one).
        self.logprobs: list[TokenLogprob] = []
        # A drafter that learns from the target's rows gets their argmax each round (core/draft.py).
        self._observes_target = bool(getattr(drafter, "observes_target", False))
        self._finishes = callable(getattr(drafter, "finish", None))
        self._never_drafts = bool(getattr(drafter, "never_drafts", False))
        self._draws_without_probs = bool(getattr(verifier, "draws_for_drafts_without_probs", False))

    def stream(self, prompt_ids: list[int], config: DecodeConfig,
               generator: torch.Generator | None = None) -> Iterator[list[int]]:
        """Yield the tokens committed by each round; ``self.stats`` describes the generation when it ends."""
        state = self.start(prompt_ids, config, generator)
        try:
            while not state.done:
                yield self.finish_round(state, self.begin_round(state).run(self.target))
        finally:
            if not state.done and self._finishes:  # the caller stopped reading before the end: the sequence is over
                self.drafter.finish()

    # The round in two halves, so that a batched engine (batch/lockstep.py) can run many sequences' target forwards
    # as one: ``begin_round`` drafts and says what the target must score, ``finish_round`` verifies and commits.
    # ``stream`` is exactly these calls with the forward in between.

    def start(self, prompt_ids: list[int], config: DecodeConfig,
              generator: torch.Generator | None = None, *, prefilled: bool = False) -> DecodeState:
        """Prefill the target with the prompt and start the drafter; ``self.stats`` starts afresh. ``prefilled``:
        the caller has already fed the target every prompt token but the last, in the forwards this method would
        make (a batched engine reads a long prompt a chunk per round, between other requests' rounds)."""
        if not prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        max_context = self.target.max_context
        if len(prompt_ids) >= max_context:
            raise ContextTooLongError.for_prompt(len(prompt_ids), max_context)
        self.stats = stats = SpecStats()
        self.logprobs = []
        tokens = list(prompt_ids)
        end = min(len(tokens) + config.max_new_tokens, max_context)

        start = time.perf_counter()
        if prefilled:
            if self.target.num_cached != len(tokens) - 1:
                raise ValueError(f"a prefilled target must hold the prompt but its last token ({len(tokens) - 1} "
                                 f"tokens); it holds {self.target.num_cached}")
        else:
            # A decode that never verifies may run on the target's fastest kernels even if batched rows would differ.
            self.target.reset(plain=self._never_drafts, length=end)
            if len(tokens) > 1:
                self.target.forward(tokens[:-1], num_logits=0)
        self.drafter.start(tokens)
        stats.prefill_seconds = time.perf_counter() - start
        # Greedy verifiers read only the argmax of each row, and sampling verifiers only the probabilities after
        # top-k (core/sampling.py), so with a top-k only each row's k largest logits: a target that can find those
        # more cheaply may. Plain decoding reads them the same way, so the two commit the same tokens.
        capabilities = self.target.capabilities
        sampling = config.sampling
        argmax_only = (sampling.greedy and capabilities.argmax_screen
                       and getattr(self.verifier, "reads_argmax_when_greedy", False))
        top_k_only = (capabilities.screened_top_k(sampling)
                      if getattr(self.verifier, "reads_top_k_when_sampling", False) else 0)
        # Temperature alone: a verifier that keeps the target's own draw for a draft without probabilities needs only
        # that draw of each row, which a screened target makes without every logit (core/sampling.py, "draws").
        draws = capabilities.draw_screen and draws_for(sampling) and self._draws_without_probs
        grammar = None
        if config.grammar is not None:
            # A grammar masks whole rows of logits: the screens, where they take the masks, find each row's best
            # (or draw) among its allowed tokens; elsewhere the rows are read whole.
            grammar = config.grammar.start()
            if not capabilities.screen_masks:
                argmax_only, top_k_only, draws = False, 0, False
        if config.penalties.active:  # they change logits a screen would not have kept: whole rows
            argmax_only, top_k_only, draws = False, 0, False
        return DecodeState(tokens, end, config, generator, argmax_only, capabilities.max_verify_rows, top_k_only,
                           draws=draws, grammar=grammar, prompt_length=len(tokens))

    def begin_round(self, state: DecodeState, *, hold_draft: bool = False) -> ForwardCall:
        """Draft (1.) and return the target forward that scores the pending token and the draft (2.). ``hold_draft``:
        the drafter gets no budget this round (as when ``max_new_tokens`` leaves no room), so the round decodes
        plainly; a batched engine holds drafts off where it measures them slower (batch/supervisor.py)."""
        tokens = state.tokens
        t0 = time.perf_counter()
        # 1. Propose, leaving room for the one token the target always adds.
        budget = 0 if hold_draft else state.end - len(tokens) - 1
        draft = self.drafter.propose(tokens, budget, state.config.sampling, state.generator)
        state.own_nodes = draft.num_nodes
        if state.grammar is not None:  # the nodes the grammar lets count, its forced tokens, every row's mask
            # Forced tokens are drafts too: plain decoding (a drafter that never drafts) reads them one a step.
            room = 0 if self._never_drafts else budget
            if state.max_verify_rows is not None:
                room = min(room, state.max_verify_rows - 1)
            # Forced tokens after an empty draft need no draft probabilities where the verifier draws the target's
            # token for drafts without them: drawn through the screen, they then draw what plain sampling draws.
            fitted = state.grammar.fit(draft, max(room, draft.num_nodes), certain_rows=not self._draws_without_probs)
            state.proposed = draft if fitted.draft is not draft else None
            draft, state.masks, state.own_nodes, state.kept = fitted.draft, fitted.masks, fitted.own, fitted.kept
        state.draft_seconds = time.perf_counter() - t0
        limit = state.max_verify_rows
        if limit is not None and 1 + draft.num_nodes > limit:
            raise UnsupportedOptionError(
                f"a draft of {draft.num_nodes} tokens needs a verification forward of {1 + draft.num_nodes} rows; "
                f"past {limit} rows this target computes a forward as it reads a prompt, not row by row, which would "
                f"change the output: draft at most {limit - 1} tokens a round (--tree, --tree-budget, "
                "--num-draft-tokens, --beam-width)")
        parents = draft.node_parents()
        state.depths = tree_depths(parents)
        assert max(state.depths, default=-1) + 1 <= state.end - len(tokens) - 1, "drafter exceeded its draft budget"
        state.draft = draft
        state.verify_start = time.perf_counter()
        # 2. Score the pending token and every draft node in one pass (input 0 is the pending token).
        draws = None
        if state.draws and draft.draft_probs is None:
            if state.draw_key is None:  # drawn at the first round that draws: methods that never do keep their stream
                state.draw_key = sequence_draw_key(state.generator)
            # Row 0 draws the token at position len(tokens); a draft node's row the one after it, by its depth.
            positions = [len(tokens)] + [len(tokens) + depth + 1 for depth in state.depths]
            draws = RowDraws(tuple(position_key(state.draw_key, p) for p in positions),
                             state.config.sampling.temperature)
        screened = bool(state.argmax_only or state.top_k_only or draws is not None)
        state.logprob_hidden = screened and state.config.logprobs is not None
        return ForwardCall([tokens[-1]] + draft.token_ids,
                           parents=None if draft.is_chain else [-1] + [p + 1 for p in parents],
                           argmax_only=state.argmax_only, top_k_only=state.top_k_only, draws=draws,
                           allowed=state.masks if screened else None, output_hidden=state.logprob_hidden)

    def finish_round(self, state: DecodeState, output: ForwardOutput, *, defer_logprobs: bool = False) -> list[int]:
        """Verify (3.) and commit (4.) what the round's forward scored; returns the tokens committed.
        ``defer_logprobs``: where the config asks for log-probabilities and the forward read a screened head, leave
        the committed rows' hidden states in ``state.pending_logprobs`` for the caller to give
        :meth:`complete_logprobs` their exact logits (a batched engine reads the head once for many sequences)."""
        tokens, draft, stats = state.tokens, state.draft, self.stats
        logits = verified_logits(output.logits, draft, tokens, state.prompt_length, state.config, state.masks)
        # 3. Verify.
        verdict = self.verifier.verify(draft, logits, state.config.sampling, state.generator)
        if self._observes_target:
            self._observe(state, draft, logits.argmax(dim=-1).tolist(), verdict.accepted)

        # 4. Commit: keep the cache entries of the committed tokens but the last, then tell the drafter.
        num_committed = len(tokens)
        self.target.keep(list(range(num_committed)) + [num_committed + i for i in verdict.accepted])
        new_tokens, stopped = committed_tokens(verdict.token_ids, state.config.eos_token_ids)
        if state.config.logprobs is not None:
            rows = committed_rows(verdict.accepted, new_tokens)
            state.logprobs = []
            if not state.logprob_hidden:  # whole rows
                self.complete_logprobs(state, output.logits[rows], new_tokens)
            elif defer_logprobs:  # the caller reads the exact head for them, with other sequences' rows
                state.pending_logprobs = (output.hidden[rows], new_tokens)
            else:  # a screened forward's rows: the exact head's logits of the rows kept
                self.complete_logprobs(state, self.target.logits_of(output.hidden[rows]), new_tokens)
        tokens.extend(new_tokens)
        if state.grammar is not None:
            state.grammar.advance(new_tokens[:-1] if stopped else new_tokens)  # an end-of-sequence token ends it
        state.num_accepted = kept_draft_tokens(verdict.num_accepted, new_tokens)
        state.num_forced = max(0, state.num_accepted - state.own_nodes)
        stats.record(state.depths, state.num_accepted, len(new_tokens), state.num_forced)
        stats.draft_seconds += state.draft_seconds
        stats.verify_seconds += time.perf_counter() - state.verify_start
        state.done = stopped or len(tokens) >= state.end
        state.stopped = stopped
        if not stopped:
            self.drafter.commit(tokens, min(verdict.num_accepted, state.own_nodes))
        if state.done and self._finishes:
            self.drafter.finish()
        state.draft = state.masks = state.proposed = None
        return new_tokens

    def complete_logprobs(self, state: DecodeState, rows: torch.Tensor, new_tokens: list[int]) -> None:
        """The round's committed tokens' figures from ``rows``, their whole logits, into ``state.logprobs`` (extended
        in place: a batched engine's event for the round may hold that list already) and the generation's."""
        figures = token_logprobs(rows, new_tokens, state.config.logprobs)
        state.logprobs.extend(figures)
        self.logprobs.extend(figures)
        state.pending_logprobs = None

    def _observe(self, state: DecodeState, draft: Draft, target_tokens: list[int], accepted: list[int]) -> None:
        """Show a drafter that learns from the target's rows what they said of its own draft. Where a grammar changed
        the draft (core/grammar.py), its kept nodes get their rows, a dropped node its own token (nothing learnt), and
        forced tokens are left out: the drafter's node ids stay its own."""
        if state.proposed is None:
            self.drafter.observe_target(draft, target_tokens, accepted)
            return
        proposed, row_of = state.proposed, {node: i + 1 for i, node in enumerate(state.kept)}
        tokens = [target_tokens[0]] + [target_tokens[row_of[node]] if node in row_of else token
                                       for node, token in enumerate(proposed.token_ids)]
        self.drafter.observe_target(proposed, tokens, [state.kept[i] for i in accepted if i < len(state.kept)])

    def generate(self, prompt_ids: list[int], config: DecodeConfig,
                 generator: torch.Generator | None = None) -> list[int]:
        """All new tokens at once."""
        out: list[int] = []
        for chunk in self.stream(prompt_ids, config, generator):
            out.extend(chunk)
        return out
