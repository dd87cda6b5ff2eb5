"""Where training prompts come from: the ``--prompts`` sources of ``train-draft`` and ``build-corpus``.

``train:default`` / ``train:chat`` / ``train:code`` (shipped, license-clean), ``self-instruct:N`` (the target writes
them), ``sharegpt:N`` (prompts with their given answers) and ``sharegpt-prompts:N``, ``builtin:NAME`` (benchmark sets,
with a warning), and ``.jsonl`` / ``.txt`` files.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from jointspec.bench.prompts import BUILTIN_PREFIX, chat_prompt_ids, load_prompts
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.files import cannot_write, replacing
from jointspec.drafts.artifact import target_fingerprint
from jointspec.train.prompts import chat_prompts, default_training_prompts, stdlib_code_prompts
from jointspec.train.selfinstruct import SelfInstructConfig, self_instruct_prompts
from jointspec.train.sharegpt import sharegpt_exchanges

log = logging.getLogger(__name__)


SELF_INSTRUCT_PREFIX = "self-instruct:"


def _count(source: str, prefix: str) -> int:
    """The N of a ``PREFIX:N`` prompt source, refused unless it is a whole number >= 1."""
    count = source[len(prefix):]
    if not count.isdigit() or int(count) < 1:
        raise UnsupportedOptionError(f"'{source}': write {prefix}N with N >= 1, e.g. {prefix}2000")
    return int(count)


def _self_instruct(source: str, target, tokenizer, eos, data_folder: Path | None, seed: int,
                   batch_size: int, progress: bool = True) -> list[str]:
    """The prompts of a ``self-instruct:N`` source, sampled once and kept in ``data_folder`` for later runs."""
    count = _count(source, SELF_INSTRUCT_PREFIX)
    if target is None:
        raise UnsupportedOptionError(f"'{source}' needs the target model to write the prompts")
    config = SelfInstructConfig(num_prompts=count, seed=seed, batch_size=batch_size)
    record = {"target_fingerprint": target_fingerprint(target), "settings": asdict(config)}
    path = data_folder / f"self-instruct-{count}-seed{seed}.json" if data_folder is not None else None
    if path is not None and path.is_file():
        saved = json.loads(path.read_text())
        if {k: saved.get(k) for k in record} == record:
            return saved["prompts"]
        log.warning("ignoring %s: it was written for another target or with other settings", path)
    try:
        prompts = self_instruct_prompts(target, tokenizer, config, eos, progress=progress)
    except ValueError as error:
        raise UnsupportedOptionError(f"'{source}': {error}") from error
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise cannot_write("the generated prompts", path, error) from error
        with replacing(path, "the generated prompts") as tmp:
            tmp.write_text(json.dumps({**record, "prompts": prompts}, indent=0))
    return prompts


SHAREGPT_PREFIX = "sharegpt:"
SHAREGPT_PROMPTS_PREFIX = "sharegpt-prompts:"


def given_answer_ids(tokenizer, prompt: str, prompt_ids: list[int], answer: str,
                     eos: frozenset[int] = frozenset()) -> list[int]:
    """Token ids of ``answer`` as the chat template puts it after ``prompt_ids``, up to its first ``eos`` token.

    Rendering the whole exchange keeps the template's own end-of-turn marker, so a given answer ends the way the
    target's answers end (and, like them, stops at it). Without a chat template, or where the rendering does not
    extend the prompt, the answer is tokenized on its own.
    """
    ids = None
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": answer}], tokenize=False)
        rendered = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if rendered[:len(prompt_ids)] == prompt_ids and len(rendered) > len(prompt_ids):
            ids = rendered[len(prompt_ids):]
    if ids is None:
        ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    ends = [i for i, token in enumerate(ids) if token in eos]
    return ids[:ends[0] + 1] if ends else ids


def jsonl_prompts(path: Path) -> list[str]:
    """Requests from a JSONL file: per line an object with ``prompt`` (a string) or ``turns`` (a list of strings, of
    which the first is used, as in the bench's prompt files). Errors name the file and line."""
    try:
        lines = path.expanduser().read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise UnsupportedOptionError(f"cannot read prompt file '{path}': {error.strerror or error}") from error
    texts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UnsupportedOptionError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno})") \
                from None
        text = row.get("prompt") if isinstance(row, dict) else None
        if text is None and isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        if not isinstance(text, str) or not text.strip():
            raise UnsupportedOptionError(f"{path}:{number}: expected an object with 'prompt' (a non-empty string) "
                                         "or 'turns' (a list whose first item is a non-empty string)")
        texts.append(text)
    return texts


def training_prompts(sources: list[str] | None, tokenizer, target=None, eos: frozenset[int] = frozenset(),
                     data_folder: Path | None = None, seed: int = 0, batch_size: int = 16,
                     progress: bool = True) -> tuple[list[list[int]], list[list[int] | None]]:
    """Prompt token ids (chat template applied) from the ``--prompts`` sources, and per prompt its given answer's
    token ids (``sharegpt:N``) or ``None`` (the target answers it). ``progress``: a bar while the target writes
    ``self-instruct:N`` prompts."""
    texts: list[str] = []
    given: list[str | None] = []
    context = _SourceContext(tokenizer, target, eos, data_folder, seed, batch_size, progress)
    for source in sources or ["train:default"]:
        prompts, answers = _read_source(source, context)
        texts.extend(prompts)
        given.extend(answers or [None] * len(prompts))  # sources without answers: the target answers
    if not texts:
        raise UnsupportedOptionError("no training prompts found in " + ", ".join(sources or []))
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in texts]
    answers = [None if answer is None else given_answer_ids(tokenizer, text, ids, answer, eos)
               for text, ids, answer in zip(texts, prompts, given)]
    unended = sum(1 for answer in answers if answer is not None and eos and not eos.intersection(answer))
    if unended:  # the head then never sees the answer end on these: worth knowing, not worth refusing
        log.warning("%d given answers have no end-of-turn token (the chat template's rendering of the exchange did "
                    "not extend the prompt, so they were tokenized on their own)", unended)
    return prompts, answers


@dataclass(frozen=True)
class _SourceContext:
    """What some prompt sources need: self-instruct asks the target and keeps its prompts in the data folder."""

    tokenizer: object
    target: object
    eos: frozenset[int]
    data_folder: Path | None
    seed: int
    batch_size: int
    progress: bool = True


def _sharegpt(source: str, context: _SourceContext) -> tuple[list[str], list[str]]:
    exchanges = sharegpt_exchanges(_count(source, SHAREGPT_PREFIX), context.seed)
    return [e.prompt for e in exchanges], [e.answer for e in exchanges]


def _builtin(source: str, context: _SourceContext) -> list[str]:
    log.warning("training on benchmark prompts (%s): measure on other prompts", source)
    return [turn for prompt in load_prompts(source) for turn in prompt.turns[:1]]


def _text_file(source: str, context: _SourceContext) -> list[str]:
    path = Path(source)
    if not path.is_file():
        raise UnsupportedOptionError(f"prompt file '{source}' does not exist")
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


# Named sources, then sources by prefix, then files by suffix. Each gives prompts, or (prompts, given answers).
_NAMED = {"train:default": lambda source, context: default_training_prompts(),
          "train:chat": lambda source, context: chat_prompts(600),
          "train:code": lambda source, context: stdlib_code_prompts(300)}
_PREFIXED = {SELF_INSTRUCT_PREFIX: lambda source, context: _self_instruct(
                 source, context.target, context.tokenizer, context.eos, context.data_folder, context.seed,
                 context.batch_size, context.progress),
             SHAREGPT_PREFIX: _sharegpt,
             SHAREGPT_PROMPTS_PREFIX: lambda source, context: [
                 e.prompt for e in sharegpt_exchanges(_count(source, SHAREGPT_PROMPTS_PREFIX), context.seed)],
             BUILTIN_PREFIX: _builtin}
_SUFFIXED = {".jsonl": lambda source, context: jsonl_prompts(Path(source)), ".txt": _text_file}


def _read_source(source: str, context: _SourceContext) -> tuple[list[str], list[str] | None]:
    reader = _NAMED.get(source)
    reader = reader or next((read for prefix, read in _PREFIXED.items() if source.startswith(prefix)), None)
    reader = reader or next((read for suffix, read in _SUFFIXED.items() if source.endswith(suffix)), None)
    if reader is None:
        raise UnsupportedOptionError(f"unknown prompt source '{source}'; use train:default, train:chat, "
                                     "train:code, self-instruct:N, sharegpt:N, sharegpt-prompts:N, "
                                     "builtin:NAME, a .jsonl file or a .txt file")
    read = reader(source, context)
    return read if isinstance(read, tuple) else (read, None)
