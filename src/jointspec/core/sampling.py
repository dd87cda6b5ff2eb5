"""Turning target/draft logits into the distribution a decoder samples from.

Convention (the same for every method, drafter and verifier, and the same as Hugging Face's default warper order):
1. divide the logits by ``temperature``;
2. keep the ``top_k`` largest logits (``top_k=0`` keeps all);
3. keep the smallest set of the most likely remaining tokens whose probability sums to at least ``top_p``
   (the most likely token is always kept; ``top_p=1`` keeps all; of tokens with equal logits the lower id comes
   first);
4. softmax over the kept tokens; every other token gets probability exactly 0.

``min_p`` (0: off) keeps only the tokens at least ``min_p`` times as likely as the most likely one, between steps 1
and 2: on the tempered logits, a token staying where its logit is at least the row's largest plus log(``min_p``). That
is vLLM's order (temperature, min-p, then top-k and top-p). Top-k gives the same set either way, top-p does not:
transformers applies min-p after top-p, and llama.cpp's sampler chain before its temperature.

On a CPU where this process has loaded the compiled kernels, the top-k search and the draw run there (``_row_kernels``):
the same bits as the PyTorch operations, in a pass over the row instead of several.

``temperature == 0`` means greedy: the distribution is one-hot on the argmax (ties go to the lowest token id, as
``torch.argmax`` does), and top-k/top-p are irrelevant.
"""

from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass

import torch

# The lowest temperature but 0: float32 logits divided by much less overflow to infinity, and their softmax to NaN
# (every probability then lost). Sampling at it is greedy in all but exact ties; 0 is greedy.
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        for name, kind in (("temperature", "a number"), ("top_k", "an int"), ("top_p", "a number"),
                           ("min_p", "a number")):
            value = getattr(self, name)
            wanted = numbers.Integral if name == "top_k" else numbers.Real  # (numpy's scalars are these too)
            if isinstance(value, bool) or not isinstance(value, wanted):
                raise TypeError(f"{name} must be {kind}, got {value!r}")
            object.__setattr__(self, name, int(value) if name == "top_k" else float(value))
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got "
                             f"{self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no top-k), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 = no min-p), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def fresh_seed() -> int:
    """A seed for a sampled request that did not give one, to report with its answer so that it can be repeated: 53
    bits, a JSON number any client (JavaScript's included) reads back exactly."""
    return secrets.randbits(53)


def processed_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, in float32.

    logits: [..., vocab]. Returns [..., vocab] rows that sum to 1. Each row gets the bits it gets alone: the shortcuts
    below sum a row's terms in another order than the general path, so where the rows of one call would take
    different ones, each row is processed as a call of its own. A round's pending row must get the probabilities
    plain sampling gives it, whatever was drafted beside it (seeded lookup drafts sample exactly ``ar``'s text).
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    rows = logits.reshape(-1, logits.shape[-1]) / sampling.temperature
    if sampling.min_p > 0.0:
        rows = _min_p_kept(rows, sampling.min_p)
    try:
        probs = _processed(rows, sampling)
    except _PathsDiffer:
        probs = torch.cat([_processed(row[None], sampling) for row in rows])
    return probs.reshape(logits.shape)


class _PathsDiffer(Exception):
    """The rows of one ``_processed`` call would not all take the same path (one row alone never raises it)."""


def _processed(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """``processed_probs`` of tempered rows [n, vocab]; raises :class:`_PathsDiffer` where they would take different
    paths."""
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        values, indices, exact = _top_k(logits, sampling.top_k)
        if bool(exact.all()):
            return _top_k_probs(values, indices, vocab, sampling.top_p)
        if bool(exact.any()):
            raise _PathsDiffer
        logits = logits.masked_fill(logits < values[..., -1:], float("-inf"))  # ties at the k-th keep every tied one
    if sampling.top_p < 1.0 and not 0 < sampling.top_k < vocab:
        nucleus = _nucleus_probs(logits, sampling.top_p)
        if nucleus is not None:
            return nucleus
    if sampling.top_p < 1.0:
        # Only finite logits can be kept, so only they need ordering: after top-k a few dozen (a head restricted to
        # its draft vocabulary leaves a third). A partial sort (topk returns its values in descending order) replaces
        # the full-vocabulary one; the -inf entries it leaves out would add exactly 0 to every sum.
        num_finite = torch.isfinite(logits).sum(dim=-1)
        if bool((num_finite != num_finite[0]).any()):  # rows of other widths: their sums would group differently
            raise _PathsDiffer
        sorted_logits, order, _ = _top_k(logits, max(int(num_finite[0]), 1))
        drop_sorted = _top_p_drop(sorted_logits.softmax(dim=-1), sampling.top_p)
        drop = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def _min_p_kept(rows: torch.Tensor, min_p: float) -> torch.Tensor:
    """Tempered rows with every token less than ``min_p`` times as likely as the row's most likely one at -inf (its
    logit below the largest plus log(``min_p``)); the most likely token always stays."""
    floor = rows.max(dim=-1, keepdim=True).values + math.log(min_p)
    return rows.masked_fill(rows < floor, float("-inf"))


def _top_p_drop(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which of the tokens, in descending order of probability, top-p drops: a token goes once the tokens before it
    already reach ``top_p``; the most likely token always stays."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p
    drop[..., 0] = False
    return drop


NUCLEUS_CANDIDATES = (256, 4096)


def _nucleus_probs(logits: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """``processed_probs`` for top-p alone, when the most likely few hundred or few thousand tokens of every row
    (``NUCLEUS_CANDIDATES``) already hold ``top_p`` of its mass (None otherwise). Every token after them is then
    dropped, so only they need sorting; a full sort of a large vocabulary costs milliseconds a row. Raises
    :class:`_PathsDiffer` where some rows would stop at a count and others not: alone, each would take its own."""
    log_total = torch.logsumexp(logits, dim=-1, keepdim=True)
    for count in NUCLEUS_CANDIDATES:
        if count >= logits.shape[-1]:
            return None
        values, indices, _ = _top_k(logits, count)
        probs = (values - log_total).exp()
        held = probs.sum(dim=-1) >= top_p
        if bool(held.all()):
            values = values.masked_fill(_top_p_drop(probs, top_p), float("-inf"))
            out = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
            return out.scatter_(-1, indices, values.softmax(dim=-1))
        if bool(held.any()):
            raise _PathsDiffer
    return None


# A compiled build of jointspec.kernels.grouped, set by that module as it loads one (the core imports no layer above
# it). Every build gives the same bits (they are held against each other); the one the layers run on is the fastest.
_LOADED_KERNELS: list = []


def use_row_kernels(module, preferred: bool) -> None:
    """Called with a kernels build as it loads: sampling's row work runs on it (``_row_kernels``) if none runs it
    yet, or if it is the ``preferred`` one (the build the process runs its layers on, not one loaded to compare)."""
    if preferred or not _LOADED_KERNELS:
        _LOADED_KERNELS[:] = [module]


def _row_kernels(rows: torch.Tensor):
    """The compiled CPU kernels where this process has loaded a build (:func:`use_row_kernels`) and ``rows`` is a
    contiguous float32 CPU matrix they read, else None: sampling never starts a build, and on any other device, or
    before a build is loaded, PyTorch's operations run, which give the same tokens."""
    if not _LOADED_KERNELS or rows.device.type != "cpu" or rows.dtype != torch.float32 or rows.dim() != 2 \
            or not rows.is_contiguous():
        return None
    return _LOADED_KERNELS[0]


# The largest k the kernels' heap takes (a full sort beats a heap of a whole vocabulary).
KERNEL_TOP_K_MAX = 4096


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest logits, largest first and ties to the lower token id (of tokens tied at the k-th,
    the lowest ids), their ids, and whether exactly ``k`` logits of the row are >= its k-th largest. [n, vocab] ->
    [n, k], [n, k], [n].

    The kernels find them in one pass and a count; ``torch.topk`` takes several times as long on a large vocabulary
    and picks and orders tied tokens as it likes, so where the row has ties its answer is made the kernels' (top-p,
    which runs over the tokens in this order, can tell tied tokens apart). A row with a NaN takes PyTorch's path."""
    module = _row_kernels(logits) if k <= KERNEL_TOP_K_MAX else None
    if module is not None:
        values, indices, counts = module.top_k_rows(logits, k)
        if bool((counts >= 0).all()):
            return values, indices, counts == k
    values, indices = torch.topk(logits, k, dim=-1)
    kth = values[:, -1:]
    exact = (logits >= kth).sum(dim=-1) == k
    # Rows with ties (inside the k, or at the k-th: not exact), each alone: a row's answer never depends on the others.
    tied_rows = ((values[:, 1:] == values[:, :-1]).any(dim=-1) | ~exact) & ~values.isnan().any(dim=-1)
    if k > 1 and bool(tied_rows.any()):
        rows = tied_rows.nonzero().squeeze(-1)
        row_logits, row_kth = logits[rows], kth[rows]
        above, tied = row_logits > row_kth, row_logits == row_kth
        chosen = above | (tied & (tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
        row_indices = chosen.nonzero()[:, -1].reshape(len(rows), k)  # each row's k tokens, in id order
        row_values, order = row_logits.gather(-1, row_indices).sort(dim=-1, descending=True, stable=True)
        values, indices = values.clone(), indices.clone()
        values[rows], indices[rows] = row_values, row_indices.gather(-1, order)
    return values, indices, exact


def _top_k_probs(values: torch.Tensor, indices: torch.Tensor, vocab: int, top_p: float) -> torch.Tensor:
    """``processed_probs`` when top-k keeps exactly k tokens per row: the softmax and top-p run over those k (in
    descending order, as ``topk`` returns them) and are scattered back, instead of over the whole vocabulary, where
    every other entry would be -inf and add exactly 0."""
    if top_p < 1.0:
        values = values.masked_fill(_top_p_drop(values.softmax(dim=-1), top_p), float("-inf"))
    probs = torch.zeros(values.shape[:-1] + (vocab,), dtype=values.dtype, device=values.device)
    return probs.scatter_(-1, indices, values.softmax(dim=-1))


def multinomial(probs: torch.Tensor, num_samples: int, *, replacement: bool = False,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.multinomial`` drawn on the generator's device, returned on ``probs``' device.

    The library seeds one CPU generator per request, and ``torch.multinomial`` refuses a generator that lives on
    another device than its input (CUDA logits with a CPU generator). A single row is drawn from its nonzero entries
    only: after top-k / top-p that is a few dozen tokens, and ``torch.multinomial`` costs time in the row's length,
    not its support. Leaving out zero-probability tokens does not change the law, with or without replacement.
    """
    source = probs if generator is None or generator.device == probs.device else probs.to(generator.device)
    if source.dim() == 1:
        support = source.nonzero().squeeze(-1)
        if 0 < support.numel() < source.numel():
            draws = support[torch.multinomial(source[support], num_samples, replacement=replacement,
                                              generator=generator)]
            return draws.to(probs.device)
    return torch.multinomial(source, num_samples, replacement=replacement, generator=generator).to(probs.device)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``probs`` ([..., vocab] -> [...]), drawn with ``generator``.

    By inverse transform: one uniform ``u`` per row, and the first token whose cumulative mass exceeds ``u`` times
    the row's total. A token of probability 0 adds nothing to the running sum, so it is never the first to exceed
    it. (``torch.multinomial`` draws the same law but costs far more per row on a large vocabulary.)
    """
    rows = probs.reshape(-1, probs.shape[-1]).float()
    device = generator.device if generator is not None else rows.device
    uniform = torch.rand(rows.shape[0], 1, generator=generator, device=device).to(rows.device)
    module = _row_kernels(rows)
    if module is not None:  # the same draws in one pass over each row's nonzero entries
        draws = module.sample_rows(rows, uniform.reshape(-1))
        if bool((draws >= 0).all()):
            return draws.reshape(probs.shape[:-1])
        # A row the kernel refuses (a negative or non-finite entry, or no mass): PyTorch's path with the same u,
        # which raises for a row without a positive, finite sum and draws as before otherwise.
    cumulative = rows.cumsum(dim=-1)
    total = cumulative[:, -1:].contiguous()
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("sample() needs rows of probabilities with a positive, finite sum; got a row summing to "
                         f"{total[~((total > 0) & torch.isfinite(total))][0].item()}")
    draws = torch.searchsorted(cumulative, uniform * total, right=True)
    # u * total can round up to the total itself: then the draw is the token where the sum reaches its total, the
    # last one that carries mass.
    last = torch.searchsorted(cumulative, total, right=False)
    return torch.minimum(draws, last).reshape(probs.shape[:-1])


def pick(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of ``logits`` ([..., vocab] -> [...]): argmax when greedy, else a sample."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return sample(processed_probs(logits, sampling), generator)


# -- draws through a screened head (temperature alone) -------------------------------------------------------------
#
# Sampling without a top-k or top-p needs every logit of a row for its normaliser, so it cannot read a screened head
# the way greedy and top-k rows do. A draw needs less: with independent Gumbel noise g, argmax(l / T + g) is a draw
# from softmax(l / T), and a screened head finds that argmax as it finds a greedy row's (kernels/grouped.py,
# ScreenedInt8Head.draw_tokens). A row's noise is keyed by its sequence's key and the position it draws for, not by
# how many rows a round scored: plain sampling and lookup drafts (whose verifiers keep the target's own draw at each
# position) then draw the same token at every position, as they do from exact logits with one uniform per token.


@dataclass(frozen=True)
class RowDraws:
    """A forward's request to draw each logit row's token instead of returning its logits: row i's token is drawn
    from softmax(logits / temperature) with the noise keyed by ``keys[i]``. The target returns rows that are 0 at the
    drawn token and -inf elsewhere (:func:`drawn_rows`), which :func:`processed_probs` reads as that token for
    certain."""

    keys: tuple[int, ...]
    temperature: float


def draws_for(sampling: SamplingConfig) -> bool:
    """Whether rows sampled with ``sampling`` may be drawn through a screen (temperature alone: no top-k, top-p or
    min-p)."""
    return not sampling.greedy and sampling.top_k == 0 and sampling.top_p == 1.0 and sampling.min_p == 0.0


def sequence_draw_key(generator: torch.Generator | None) -> int:
    """A sequence's noise key, drawn once from its generator (a seeded request repeats its draws)."""
    return int(torch.randint(0, 2 ** 62, (1,), generator=generator))


def position_key(sequence_key: int, position: int) -> int:
    """The noise key of the token at ``position`` of the sequence keyed ``sequence_key`` (an int64)."""
    return (sequence_key * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03) % 2 ** 63


def drawn_rows(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows] drawn token ids -> [rows, vocab] float32 rows, 0 at each token and -inf elsewhere."""
    rows = torch.full((len(tokens), vocab), float("-inf"))
    return rows.scatter_(1, tokens.reshape(-1, 1).long().cpu(), 0.0)
