"""Prompt lookup first, a draft model otherwise: free long drafts where the text repeats, model drafts elsewhere.

Prompt lookup drafts cost nothing and, where an answer copies its input (summaries, code edits, extraction), are
accepted in long runs; on open-ended text they rarely match, and a trained draft head does better. Each round this
drafter asks prompt lookup first and falls back to the model drafter when no n-gram matches. Both see every
``start`` and ``commit``: the lookup drafter adapts its length only after its own drafts (it tracks what it proposed),
and the model drafter's cache catches up on whatever was committed while it was idle (see
:class:`~jointspec.drafters.model.ModelDrafter`).
"""

from __future__ import annotations

import torch

from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.model import ModelDrafter
from jointspec.drafters.ngram import PromptLookupDrafter


class HybridDrafter:
    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter) -> None:
        self.lookup = lookup
        self.model = model
        self.num_lookup_rounds = 0
        self.num_model_rounds = 0

    @property
    def draft(self):
        """The draft model (cost-aware wrapping prices draft tokens at its cost, an upper bound for lookups)."""
        return self.model.draft

    def start(self, prompt_ids: list[int]) -> None:
        self.lookup.start(prompt_ids)
        self.model.start(prompt_ids)
        self.num_lookup_rounds = self.num_model_rounds = 0

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        draft = self.lookup.propose(context_ids, max_num_draft_tokens, sampling, generator)
        if draft.num_nodes:
            self.num_lookup_rounds += 1
            return draft
        self.num_model_rounds += 1
        return self.model.propose(context_ids, max_num_draft_tokens, sampling, generator)

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        self.lookup.commit(context_ids, num_accepted)
        self.model.commit(context_ids, num_accepted)
