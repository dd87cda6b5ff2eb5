"""PEARL (Liu et al., 2024, "PEARL: Parallel Speculative Decoding with Adaptive Draft Length"): the draft model keeps
drafting while the target verifies.

Each round proposes the first tokens of a *chain* the draft model is drafting, and hands the chain to a worker thread
that drafts ``num_draft_tokens`` more tokens after it while the loop's target forward runs. The next round uses
those tokens only as far as the committed text agrees with the chain; where it does not, the chain is dropped and
the draft starts a new one from the committed text. How much a round proposes follows PEARL's two modes:

- *pre-verify*, after a round that rejected a draft token: propose one token, so that the target judges it while
  the draft drafts the rest. A wrong first token then costs one row, not a chain.
- *post-verify*, after a round that kept its whole draft: propose every token the worker drafted past the committed
  text (or ``num_draft_tokens`` new ones where none follows it), while the draft drafts on as if all were kept.

Unlike PEARL's own loop, this one adds the target's token after every round (the bonus token after a fully kept
draft). The chain drafted meanwhile then survives only where its next token is that bonus token, which a draft
model that agrees with its target often guesses.

Lossless: every proposed token was drawn from the distribution its draft row reports (greedy: the draft's argmax),
so the loop's usual verifiers apply unchanged. Timing changes nothing either: a round waits for the worker's whole
count before it reads the chain, the worker stops early only on a chain the committed text has already left, and a
sampled chain draws from a generator of its own, seeded from the loop's generator and the position it starts at.

Threads: while both run, torch's threads are split between them (each half, at least one): the loop's thread halves
its count for the target's forward and takes it back at ``commit`` (or ``finish``, after the sequence's last round).
A draft that reads the target's features (a trained head) reads none past the committed text while the target's
forward runs (``FeatureDraft.feature_horizon``). What the overlap is worth where the draft and the target share a
few cores: docs/methods.md, ``pearl``.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from jointspec.backends.hf import CausalLM, lean_forward_of
from jointspec.core.draft import EMPTY_DRAFT, Draft
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.drafters.model import draft_room
from jointspec.drafts.artifact import FeatureDraft


class ThreadSplit:
    """The torch thread counts of the two sides. Each thread has its own (a thread's call sets its own count), so the
    loop's thread halves its count while the worker drafts beside its target forward and the worker takes the other
    half; the worker drafting alone, the loop waiting for it, takes them all."""

    def __init__(self) -> None:
        self.full = torch.get_num_threads()
        self.half = max(1, self.full // 2)

    def split(self) -> None:  # on the loop's thread
        torch.set_num_threads(self.half)

    def restore(self) -> None:  # on the loop's thread
        torch.set_num_threads(self.full)

    def worker(self, beside_target: bool) -> None:  # on the worker
        torch.set_num_threads(self.half if beside_target else self.full)


class ParallelDrafter:
    """Drafts chains with a draft model on a worker thread that keeps drafting while the target verifies."""

    def __init__(self, draft: CausalLM, num_draft_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if isinstance(draft, CausalLM) and draft.lean is not None:
            # A fork of the target (``--draft self``) shares the target's lean forward, whose compiled layers keep
            # the cache they were last given: two threads must not call one at once, so the worker gets its own.
            draft.lean = lean_forward_of(draft.model)
        self.draft = draft
        self.num_draft_tokens = num_draft_tokens
        self.split_threads = draft.device.type == "cpu"  # torch's CPU threads; a GPU draft needs none of them
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pearl-draft")
        weakref.finalize(self, self._executor.shutdown, wait=False)
        self._stop = threading.Event()  # the running continuation is no use: stop after the current token
        self._pending: Future | None = None
        self._threads: ThreadSplit | None = None
        self.start([])

    # -- the loop's calls ----------------------------------------------------------------------------------------------

    def start(self, prompt_ids: list[int]) -> None:
        self._wait()
        if self._threads is not None:  # a round left between propose and commit (outside stream()) kept them split
            self._threads.restore()
        self.draft.reset()
        self._threads = ThreadSplit() if self.split_threads else None
        self._prefix: list[int] = []  # the committed text the chain continues (its draft cache holds it, in part)
        self._chain: list[int] = []
        self._rows: list[torch.Tensor] = []  # the distribution each chain token was drawn from (sampling)
        self._chain_generator: torch.Generator | None = None
        self._seed: int | None = None  # drawn from the loop's generator at the first sampled round
        self._whole_draft_kept = True  # PEARL starts in post-verify
        self.worker_rounds = 0  # rounds that proposed tokens the worker drafted while the round before was verified
        self._proposed = 0
        self._next = 0
        self._horizon = 0

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        self._wait()
        self._stop.clear()
        self._proposed = 0
        if max_num_draft_tokens <= 0:
            return EMPTY_DRAFT
        if not sampling.greedy and self._seed is None:
            self._seed = int(torch.randint(2 ** 62, (1,), generator=generator))
        self._horizon = len(context_ids) - 1  # the target's features so far: the committed text but its last token
        ahead = self._reconcile(context_ids)
        self.worker_rounds += ahead > 0
        # Post-verify proposes what the worker drafted (or a new chain's first num_draft_tokens), pre-verify one token.
        wanted = min((ahead or self.num_draft_tokens) if self._whole_draft_kept else 1, max_num_draft_tokens)
        if ahead < wanted:  # not drafted that far yet: draft the rest now, on the worker, and wait for it
            self._run(self._extend, wanted - ahead, sampling)
            self._wait()
        first = len(context_ids) - len(self._prefix)
        token_ids = self._chain[first:first + wanted]
        rows = None if sampling.greedy or not token_ids else torch.stack(self._rows[first:first + wanted])
        self._proposed = len(token_ids)
        self._next = first + len(token_ids)  # the chain token the target's own token must equal for the chain to last
        # Draft on while the target verifies, as if every proposed token were kept: num_draft_tokens more, but none
        # the sequence's length or context could not use (the target's own token, then the next round's budget).
        more = min(self._next + self.num_draft_tokens,
                   self._next + max_num_draft_tokens - len(token_ids)) - len(self._chain)
        if more > 0:
            if self._threads is not None:
                self._threads.split()
            self._run(self._extend, more, sampling, beside_target=True)
        return Draft(token_ids=token_ids, draft_probs=rows)

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        self._whole_draft_kept = num_accepted == self._proposed
        chain = self._chain  # the worker only appends to it: reading it here is safe
        if not self._whole_draft_kept or (self._next < len(chain) and chain[self._next] != context_ids[-1]):
            self._stop.set()  # the committed text leaves the chain: what the worker drafts after it is no use
        if self._threads is not None:
            self._threads.restore()  # the target's forward is over: the loop's thread takes its count back

    def finish(self) -> None:
        """The sequence is over: stop the worker and give the target back every thread before the caller goes on."""
        self._stop.set()
        self._wait()
        if self._threads is not None:
            self._threads.restore()

    # -- the chain -----------------------------------------------------------------------------------------------------

    def _reconcile(self, context_ids: list[int]) -> int:
        """Keep the chain if the committed text follows it, else start a new one; returns how many chain tokens lie
        past the committed text."""
        committed = len(context_ids) - len(self._prefix)
        if (self._prefix and 0 <= committed <= len(self._chain)
                and context_ids[len(self._prefix):] == self._chain[:committed]):
            return len(self._chain) - committed
        # A new chain from the committed text: the draft keeps what it shares with it (it may keep less).
        cached = self._prefix + self._chain
        keep, most = 0, min(len(cached), len(context_ids) - 1, self.draft.num_cached)
        while keep < most and cached[keep] == context_ids[keep]:
            keep += 1
        self.draft.crop(keep)
        self._prefix = list(context_ids)
        self._chain, self._rows = [], []
        if self._seed is not None:
            self._chain_generator = torch.Generator().manual_seed(self._seed + len(context_ids))
        return 0

    def _extend(self, count: int, sampling: SamplingConfig) -> None:
        """Draft ``count`` more chain tokens (runs on the worker)."""
        for _ in range(count):
            if self._stop.is_set():
                return
            # Feed what the draft has not seen of the committed text and the chain (its last token, or more after a
            # crop), for the logits after the chain's end; without copying the whole text each token.
            seen = self.draft.num_cached - len(self._prefix)
            unseen = self._chain[seen:] if seen >= 0 else self._prefix[seen:] + self._chain
            if draft_room(self.draft, self._prefix + self._chain) <= 0:
                return  # the draft's own window is full (drafters/model.py, draft_room): the chain ends here
            logits = self.draft.forward(unseen, num_logits=1).logits[-1]
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                probs = processed_probs(logits, sampling)  # [vocab]
                token = int(sample(probs, self._chain_generator))
                self._rows.append(probs)
            self._chain.append(token)

    # -- the worker ----------------------------------------------------------------------------------------------------

    def _run(self, work, *args, beside_target: bool = False) -> None:
        self._pending = self._executor.submit(self._job, work, args, self._horizon, beside_target)

    def _job(self, work, args, horizon: int, beside_target: bool) -> None:
        if self._threads is not None:
            self._threads.worker(beside_target)
        feature_draft = isinstance(self.draft, FeatureDraft)
        if feature_draft:
            self.draft.feature_horizon = horizon
        try:
            # On a GPU the draft's kernels queue on the same stream as the target's (torch's current stream, per
            # device): what overlaps is each side's host work, and the draft's rows are ordered before their use.
            work(*args)
        finally:
            if feature_draft:
                self.draft.feature_horizon = None

    def _wait(self) -> None:
        """Wait for the worker's job; its error, if any, is raised here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
