"""Structured output through speculation: a grammar every committed token keeps valid (JSON, a regex, Lark).

The constraint changes the target's distribution, not the loop: at every position the tokens the grammar forbids get
a logit of minus infinity before the verifier reads the row, so each position's distribution is the target's
renormalised over the allowed tokens, which is what plain constrained decoding samples from (temperature, top-k and
top-p then apply to the masked logits, as in llama.cpp and vLLM). A row's mask depends only on the tokens before it,
so the rows of a verification get the masks plain decoding would give them one step at a time: greedy speculative
decoding stays token for token plain constrained decoding, and sampling keeps its law.

Drafts are checked against the grammar before the target scores them. A draft node whose token the grammar forbids
can never be accepted (its masked probability is zero), so the nodes after it are dropped. The node itself is dropped
too where the draft is deterministic (no draft probabilities: verified as a certain token, its rejection leaves the
row's distribution as it was). A sampled draft's forbidden node stays, as a leaf: speculative sampling's residual
after rejecting it, max(0, p - q), is what keeps the law exact, and dropping it would sample from p instead.

The grammar engine is llguidance (PyPI ``llguidance``: the one llama.cpp and vLLM's guidance backend use), imported
only when a grammar is compiled: ``pip install 'jointspec[structured]'``.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from jointspec.core.draft import Draft
from jointspec.core.errors import JointspecError

FORMAT_KINDS = ("json", "regex", "lark")

# JSON as json.dumps writes it: no whitespace but one space after each comma and colon. Small models let loose on
# JSON's optional whitespace write it without end (a 135M model wrote tabs until its length ran out), and with one
# way to write the punctuation the grammar forces keys and separators, which then cost no draft. A schema's own
# "x-guidance" options replace these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Output formats a pipeline or a server keeps compiled (RecentGrammars): each takes milliseconds to compile, and
# callers repeat their schemas.
MAX_GRAMMARS = 64

# The LLTokenizer built for each (tokenizer, vocabulary size, end-of-sequence ids): reading a 50k vocabulary's token
# bytes takes a few tenths of a second, and a server compiles a grammar per request.
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GrammarError(JointspecError, ValueError):
    """A grammar, schema or pattern that cannot constrain decoding (the message says why)."""


@dataclass(frozen=True)
class OutputFormat:
    """What an answer must match. ``kind``: ``json`` (``spec`` a JSON schema as JSON text; empty: any JSON object,
    OpenAI's ``json_object``), ``regex`` (a regular expression the whole answer matches) or ``lark`` (a Lark grammar,
    llguidance's dialect)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in FORMAT_KINDS:
            raise ValueError(f"output format kind must be one of {', '.join(FORMAT_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise TypeError(f"output format spec must be a string, got {type(self.spec).__name__}")
        if self.kind != "json" and not self.spec:
            what = "pattern" if self.kind == "regex" else "grammar"
            raise ValueError(f"a {self.kind} output format needs its {what}")
        if self.kind == "json" and self.spec:
            _schema_object(self.spec)

    @classmethod
    def json_schema(cls, schema: dict | str | None = None) -> OutputFormat:
        """JSON that the schema accepts (None: any JSON object)."""
        if schema is None:
            return cls("json")
        # (its properties in their order: the answer writes them so)
        return cls("json", json.dumps(_schema_object(schema)))

    def check(self) -> None:
        """Refuse a format llguidance cannot compile, naming why, before any tokenizer is at hand (a command checks
        its format before it loads a model)."""
        error = _llguidance().LLMatcher.validate_grammar(self.grammar_text(), None)
        if error:
            raise GrammarError(f"the {self.kind} output format cannot be used: {one_line(error)}")

    def grammar_text(self) -> str:
        """The format as llguidance's grammar (not yet checked against a tokenizer)."""
        matcher = _llguidance().LLMatcher
        if self.kind == "json":
            schema = json.loads(self.spec) if self.spec else {"type": "object"}
            try:
                return matcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
            except ValueError as error:
                raise GrammarError(f"the JSON schema cannot be compiled: {error}") from None
        return matcher.grammar_from_regex(self.spec) if self.kind == "regex" else matcher.grammar_from_lark(self.spec)


def _schema_object(schema: dict | str) -> dict:
    """``schema`` (a JSON schema, or its text) as a dict, refused where it is not valid JSON or not a JSON object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    return schema


def one_line(message: str) -> str:
    """llguidance's multi-line message (with its caret drawings) as one line, for an error line."""
    return " ".join(message.split())


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (the tokenizer bridge)
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError:
        raise JointspecError("structured output needs the llguidance package: pip install 'jointspec[structured]' "
                             "(or pip install llguidance)") from None
    return llguidance


class Grammar:
    """An output format compiled for one tokenizer and vocabulary: shared by every sequence that decodes with it
    (each gets its own :class:`GrammarState` from :meth:`start`)."""

    def __init__(self, output_format: OutputFormat, tokenizer, vocab_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        llguidance = _llguidance()
        if tokenizer is None:
            raise GrammarError("structured output needs the model's tokenizer (to know each token's text)")
        if not eos_token_ids:
            raise GrammarError("structured output needs the model's end-of-sequence token ids: an answer ends where "
                               "its grammar is complete, and the decoding must stop there")
        self.output_format = output_format
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._tokenizer = _ll_tokenizer(tokenizer, vocab_size, self.eos_token_ids)
        self._text = output_format.grammar_text()
        error = llguidance.LLMatcher.validate_grammar(self._text, self._tokenizer)
        if error:
            raise GrammarError(f"the {output_format.kind} output format cannot be used: {one_line(error)}")

    def start(self) -> GrammarState:
        """A matcher at the start of an answer."""
        return GrammarState(self)


class RecentGrammars:
    """Compiled output formats, the :data:`MAX_GRAMMARS` most recently used kept; safe to share between threads (a
    server compiles on worker threads)."""

    def __init__(self) -> None:
        self._grammars: OrderedDict[OutputFormat, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, output_format: OutputFormat, make: Callable[[], Grammar]) -> Grammar:
        """The grammar compiled for ``output_format``, made by ``make()`` on first use."""
        with self._lock:
            if output_format not in self._grammars:
                self._grammars[output_format] = make()
                while len(self._grammars) > MAX_GRAMMARS:
                    self._grammars.popitem(last=False)
            self._grammars.move_to_end(output_format)
            return self._grammars[output_format]


def _ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
    key = (vocab_size, tuple(sorted(eos_token_ids)))
    try:
        built = _TOKENIZERS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: built each time
        built = {}
    if key not in built:
        try:
            built[key] = _llguidance().hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                         eos_token=sorted(eos_token_ids))
        except Exception as error:  # llguidance names what it could not read (a slow tokenizer, no vocabulary)
            raise GrammarError(f"structured output cannot read this tokenizer's vocabulary "
                               f"({type(tokenizer).__name__}, for a model of {vocab_size} ids ending at "
                               f"{sorted(eos_token_ids)}): {error}") from None
    return built[key]


class GrammarState:
    """One answer's place in its grammar: which tokens may come next, and the masks of a draft's rows.

    A draft's rows are read ahead on copies of the matcher, never by consuming and rolling back: llguidance (1.9.1)
    can leave a matcher rolled back past a computed mask out of step with the tokens it holds, and its next masks
    wrong (tests/test_core_grammar.py has the case). The answer's own matcher only ever consumes committed tokens."""

    def __init__(self, grammar: Grammar, matcher=None) -> None:
        llguidance = _llguidance()
        self.grammar = grammar
        self._numpy = llguidance.numpy
        self._matcher = (matcher if matcher is not None
                         else llguidance.LLMatcher(grammar._tokenizer, grammar._text, log_level=0))
        self._bits = self._numpy.allocate_token_bitmask(1, grammar.vocab_size)
        self._check()

    def copy(self) -> GrammarState:
        """A state at the same place that goes on alone (a look-ahead)."""
        return GrammarState(self.grammar, self._matcher.deep_copy())

    def _check(self) -> None:
        if self._matcher.is_error():  # past llguidance's limits (a grammar too ambiguous to follow), say
            raise GrammarError(f"the grammar matcher stopped: {self._matcher.get_error()}; simplify the grammar")

    def allowed(self) -> torch.Tensor:
        """The tokens that may come next: bool [vocab] (end-of-sequence tokens where the answer may end there)."""
        self._numpy.fill_next_token_bitmask(self._matcher, self._bits, 0)
        self._check()
        bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[:self.grammar.vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def advance(self, token_ids: list[int]) -> None:
        """Consume committed tokens (each allowed where it stands: the masks made sure)."""
        if token_ids and not self._matcher.consume_tokens([int(t) for t in token_ids]):
            raise RuntimeError(f"a committed token broke the grammar: {self._matcher.get_error()}")

    def _end_row(self) -> torch.Tensor:
        """The allowed tokens of a row after an end-of-sequence token, which nothing commits: the end again, so that
        the row is never empty (a verifier still reads it)."""
        row = torch.zeros(self.grammar.vocab_size, dtype=torch.bool)
        row[[token for token in self.grammar.eos_token_ids if token < len(row)]] = True
        return row

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model would say (a JSON key, its quotes and colon)."""
        return list(self._matcher.compute_ff_tokens())

    def fit(self, draft: Draft, budget: int, certain_rows: bool = True) -> Fitted:
        """``draft`` without the nodes that can never be accepted (module docstring), a chain extended by the tokens
        the grammar forces after it (within ``budget`` nodes in all), and the allowed tokens of each of the
        verification's rows. ``certain_rows``: tokens forced after an empty draft come with one-hot rows of draft
        probabilities, for a verifier that needs them; without, they come as a draft without probabilities (which
        a verifier that draws the target's token for such drafts verifies by that draw, as plain sampling does)."""
        parents = draft.node_parents()
        probabilistic = draft.draft_probs is not None or draft.draft_logprobs is not None
        children: list[list[int]] = [[] for _ in range(draft.num_nodes + 1)]  # [0]: the roots
        for node, parent in enumerate(parents):
            children[parent + 1].append(node)
        rows: dict[int, torch.Tensor] = {}
        leaves: set[int] = set()  # forbidden nodes kept for their rejection
        after: dict[int, GrammarState] = {}  # the state after a node (a chain's last: where forced tokens follow)
        root = self.allowed()

        def visit(node: int, state: GrammarState, allowed: torch.Tensor) -> None:
            """``state``: where the node's parent left the answer (``allowed`` its row), this node's to consume."""
            token = draft.token_ids[node]
            if not (0 <= token < len(allowed) and allowed[token]):
                if probabilistic:
                    rows[node] = torch.ones_like(root)
                    leaves.add(node)
                return
            if token in self.grammar.eos_token_ids:
                # The answer ends here, where its grammar allows: the matcher consumes no end-of-sequence token (a
                # complete grammar refuses one), and nothing after it is committed, so its subtree goes.
                rows[node] = self._end_row()
                return
            state.advance([token])
            after[node] = state
            rows[node] = state.allowed()
            below = children[node + 1]
            for i, child in enumerate(below):  # the last child goes on in this state, the others in copies
                visit(child, state if i == len(below) - 1 else state.copy(), rows[node])

        for node in children[0]:
            visit(node, self.copy(), root)
        kept = sorted(rows)
        fitted = draft if len(kept) == draft.num_nodes else subset(draft, kept)
        masks = [root] + [rows[node] for node in kept]
        if fitted.is_chain and not leaves and budget > len(kept) and (not kept or kept[-1] in after):
            end = after[kept[-1]] if kept else self.copy()
            fitted, extra = self._extend(fitted, budget - len(kept), certain_rows, end)
            masks.extend(extra)
        return Fitted(fitted, torch.stack(masks), kept)

    def _extend(self, chain: Draft, room: int, certain_rows: bool,
                end: GrammarState) -> tuple[Draft, list[torch.Tensor]]:
        """``chain`` followed by up to ``room`` tokens the grammar forces after it, and their rows' allowed tokens.
        A forced token is drafted as certain (a one-hot row where the draft has probabilities): where the grammar
        allows it alone, verification keeps it whatever the model says."""
        forced = end.forced()[:room]  # (``end``: a look-ahead state after the chain, which this goes on consuming)
        rows = []
        for token in forced:  # (llguidance's forced tokens never hold the end of sequence: fit's visit handles it)
            end.advance([token])
            rows.append(end.allowed())
        if not forced:
            return chain, rows
        probs = chain.draft_probs
        if probs is not None or (certain_rows and not chain.token_ids):
            # Rows for the forced tokens (after an empty chain too: a verifier of sampled drafts may need them).
            like = probs if probs is not None else torch.empty(0, self.grammar.vocab_size)
            certain = torch.zeros(len(forced), like.shape[-1], dtype=like.dtype, device=like.device)
            certain[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
            probs = certain if probs is None else torch.cat([probs, certain])
        logprobs = chain.draft_logprobs
        if logprobs is not None:
            logprobs = torch.cat([logprobs, logprobs.new_zeros(len(forced))])
        return Draft(chain.token_ids + forced, draft_probs=probs, draft_logprobs=logprobs), rows


@dataclass
class Fitted:
    """A round's draft as the grammar lets it be verified: ``draft`` (the drafter's nodes that can count, then any
    forced tokens), ``masks`` (bool [1 + nodes, vocab]: row 0 the pending token's, row i + 1 node i's; all True for a
    forbidden node kept as a leaf, which nothing reads) and ``kept`` (the drafter's nodes among them, by their index in
    its own draft: the verified draft's first ``len(kept)`` nodes; the loop tells the drafter of no more accepted
    than those, and maps what a drafter that watches the target's rows sees back to its own draft)."""

    draft: Draft
    masks: torch.Tensor
    kept: list[int]

    @property
    def own(self) -> int:
        return len(self.kept)


def subset(draft: Draft, kept: list[int]) -> Draft:
    """The draft's nodes ``kept`` (increasing; every kept node's parent kept too), renumbered; still a chain where
    it was one."""
    where = {node: i for i, node in enumerate(kept)}
    parents = None
    if draft.parents is not None:
        parents = [-1 if draft.parents[node] == -1 else where[draft.parents[node]] for node in kept]
    index = torch.tensor(kept, dtype=torch.long)
    return Draft(token_ids=[draft.token_ids[node] for node in kept],
                 draft_probs=None if draft.draft_probs is None else draft.draft_probs[index],
                 parents=parents,
                 draft_logprobs=None if draft.draft_logprobs is None else draft.draft_logprobs[index])


def masked_logits(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``logits`` [rows, vocab] with every forbidden token at minus infinity (``masks``: the allowed ones)."""
    return logits.masked_fill(~fit_width(masks, logits.shape[-1]).to(logits.device), float("-inf"))


def fit_width(masks: torch.Tensor, width: int) -> torch.Tensor:
    """``masks`` [rows, vocab] as [rows, width]: a model's logits may be wider than its tokenizer's vocabulary (the
    extra ids are never allowed) or narrower (the ids past them cannot be drawn)."""
    if masks.shape[-1] == width:
        return masks
    fitted = torch.zeros(masks.shape[0], width, dtype=torch.bool)
    common = min(width, masks.shape[-1])
    fitted[:, :common] = masks[:, :common]
    return fitted
