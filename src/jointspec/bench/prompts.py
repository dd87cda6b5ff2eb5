"""Prompt sets in the MT-Bench / Spec-Bench JSONL format, and the conversations built from them.

One JSON object per line: ``question_id`` (any JSON value), ``category`` (text) and ``turns`` (a non-empty list of
user turns). Turn 2 is asked after the model's *own* answer to turn 1, as in Spec-Bench; other keys (e.g. MT-Bench's
``reference``) are ignored. Built-in sets ship in ``jointspec/data`` and are named ``builtin:NAME``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from jointspec.core.errors import ContextTooLongError, JointspecError

BUILTIN_PREFIX = "builtin:"


class PromptSetError(JointspecError):
    """A prompt file is missing, malformed, or the selection leaves no prompts."""


@dataclass(frozen=True)
class BenchPrompt:
    question_id: str
    category: str
    turns: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"prompt {self.question_id} has no turns")


def builtin_names() -> list[str]:
    folder = resources.files("jointspec") / "data"
    return sorted(p.name[:-len(".jsonl")] for p in folder.iterdir() if p.name.endswith(".jsonl"))


def load_prompts(source: str) -> list[BenchPrompt]:
    """Read ``source``: a JSONL path or ``builtin:NAME``. Errors name the file and line."""
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX):].replace("-", "_")
        if name not in builtin_names():
            raise PromptSetError(f"unknown built-in prompt set '{name}'; choose one of: "
                                 + ", ".join(BUILTIN_PREFIX + n for n in builtin_names()))
        text = (resources.files("jointspec") / "data" / f"{name}.jsonl").read_text(encoding="utf-8")
        return parse_jsonl(text, f"{BUILTIN_PREFIX}{name}")
    path = Path(source).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise PromptSetError(f"cannot read prompt file '{source}': {error.strerror or error}") from error
    return parse_jsonl(text, source)


def parse_jsonl(text: str, where: str) -> list[BenchPrompt]:
    prompts: list[BenchPrompt] = []
    places: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptSetError(f"{where}:{number}: not valid JSON ({error.msg} at column {error.colno})") from None
        _add_unique(prompts, places, _prompt_from_row(row, f"{where}:{number}"), f"{where}:{number}")
    return prompts


def load_prompt_sets(sources: list[str]) -> list[BenchPrompt]:
    """The prompts of every source in order, refusing a question id that two sources share."""
    prompts: list[BenchPrompt] = []
    places: dict[str, str] = {}
    for source in sources:
        for prompt in load_prompts(source):
            _add_unique(prompts, places, prompt, source)
    return prompts


def _add_unique(prompts: list[BenchPrompt], places: dict[str, str], prompt: BenchPrompt, where: str) -> None:
    """Append ``prompt``, refusing an id already in ``places`` (id -> where it was): results and replays find
    prompts by id, so a repeated one would pair an answer with the wrong prompt."""
    if prompt.question_id in places:
        raise PromptSetError(f"{where}: question_id {prompt.question_id} is also at {places[prompt.question_id]}; "
                             "give each prompt its own id")
    places[prompt.question_id] = where
    prompts.append(prompt)


def _prompt_from_row(row: object, where: str) -> BenchPrompt:
    if not isinstance(row, dict):
        raise PromptSetError(f"{where}: expected a JSON object with question_id, category and turns")
    missing = [key for key in ("question_id", "category", "turns") if key not in row]
    if missing:
        raise PromptSetError(f"{where}: missing key(s) {', '.join(missing)} (need question_id, category, turns)")
    turns = row["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise PromptSetError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    if not isinstance(row["category"], str) or not row["category"]:
        raise PromptSetError(f"{where}: 'category' must be a non-empty string")
    return BenchPrompt(str(row["question_id"]), row["category"], tuple(turns))


def select_prompts(prompts: list[BenchPrompt], categories: list[str] | None = None,
                   num_per_category: int | None = None, max_turns: int | None = None) -> list[BenchPrompt]:
    """Keep ``categories`` (all if None), the first ``num_per_category`` of each, and at most ``max_turns`` turns."""
    available = list(dict.fromkeys(p.category for p in prompts))
    if categories:
        unknown = [c for c in categories if c not in available]
        if unknown:
            raise PromptSetError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                                 f"this prompt set has: {', '.join(available) or '(none)'}")
    chosen: list[BenchPrompt] = []
    counts: dict[str, int] = {}
    for prompt in prompts:
        if categories and prompt.category not in categories:
            continue
        if num_per_category is not None and counts.get(prompt.category, 0) >= num_per_category:
            continue
        counts[prompt.category] = counts.get(prompt.category, 0) + 1
        turns = prompt.turns[:max_turns] if max_turns else prompt.turns
        chosen.append(BenchPrompt(prompt.question_id, prompt.category, turns))
    if not chosen:
        raise PromptSetError("the prompt set is empty" + (" after selecting categories" if categories else ""))
    return chosen


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation ending in a user turn, ready for the assistant's answer.

    Uses the tokenizer's chat template (``template_kwargs``: further variables for it), as `generate` and `serve`
    read a chat (message text as text); without one, the turns are joined as plain text.
    """
    if getattr(tokenizer, "chat_template", None):
        from jointspec.backends.tokens import chat_template_ids  # (here: it imports torch, this module does not)

        return list(chat_template_ids(tokenizer, messages, template_kwargs=template_kwargs))
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer(text)["input_ids"])


def check_prompts_fit(prompts: list[BenchPrompt], tokenizer, max_context: int,
                      template_kwargs: dict | None = None) -> None:
    """Refuse, before anything runs, the prompts whose turns cannot fit ``max_context`` tokens even with empty
    answers before them (a turn is asked after the method's own earlier answers, so this is the least it needs);
    otherwise a bench ran every prompt before the first such one, which could be hours, and then stopped."""
    too_long = []
    for prompt in prompts:
        messages: list[dict[str, str]] = []
        for turn, text in enumerate(prompt.turns):
            messages.append({"role": "user", "content": text})
            length = len(chat_prompt_ids(tokenizer, messages, template_kwargs))
            if length >= max_context:
                too_long.append(f"{prompt.question_id} (turn {turn + 1}: {length:,} tokens)")
                break
            messages.append({"role": "assistant", "content": ""})
    if too_long:
        shown = ", ".join(too_long[:5]) + (f" and {len(too_long) - 5} more" if len(too_long) > 5 else "")
        raise ContextTooLongError(
            f"{len(too_long)} of {len(prompts)} prompts do not fit the model's context of {max_context:,} tokens: "
            f"{shown}; leave them out (--categories, or a prompt file without them) or use a model with a longer "
            "context")
