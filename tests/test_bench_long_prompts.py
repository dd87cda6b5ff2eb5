"""The built-in long-input prompt set (``builtin:long``, built by scripts/build_long_prompts.py): three size buckets of
four tasks each, one non-empty turn per prompt, every item naming its source and licence, and each prompt's chat
token count (SmolLM2's tokenizer and template, as ``jointspec bench`` builds it) inside its bucket.

The token check needs the embedded model's tokenizer: skipped when the default model is not prepared locally (tests
never download), failed in CI, whose .ci/run prepares it. Deterministic: no false-failure odds.
"""

from __future__ import annotations

import json
import os
from importlib import resources

import pytest

from jointspec.bench.prompts import chat_prompt_ids, load_prompts, select_prompts

BUCKETS = {"2k": (1900, 2100), "4k": (3900, 4100), "7k": (6900, 7100)}
TASKS = {"summarise", "qa", "extract", "edit"}
LICENCES = {"MIT", "BSD-3-Clause", "Apache-2.0", "Apache-2.0 OR BSD-2-Clause"}


def test_three_buckets_of_four_tasks():
    prompts = load_prompts("builtin:long")
    assert len(prompts) == 12
    found = {(p.category, p.question_id.split("/")[2].split("-")[0]) for p in prompts}
    assert found == {(bucket, task) for bucket in BUCKETS for task in TASKS}
    for prompt in prompts:
        assert prompt.question_id.startswith(f"long/{prompt.category}/")
        assert len(prompt.turns) == 1 and prompt.turns[0].strip()
    assert {p.category for p in select_prompts(prompts, ["7k"])} == {"7k"}


def test_every_item_names_its_source_and_licence():
    text = (resources.files("jointspec") / "data" / "long.jsonl").read_text(encoding="utf-8")
    for row in map(json.loads, text.splitlines()):
        source = row["source"]
        assert source["package"] and source["version"] and source["path"] and source["copyright"]
        assert source["licence"] in LICENCES
        assert row["reference"] or row["task"] == "summarise"
        if row["task"] == "qa":
            assert row["reference"] in row["turns"][0]


def test_chat_token_counts_are_in_their_buckets():
    from jointspec.backends import embedded

    if not embedded.is_prepared():
        if os.environ.get("CI") == "true":  # .ci/run prepares it: a skip there would hide a wrong bucket
            pytest.fail(f"CI: the default model is not prepared in {embedded.default_model_dir()}")
        pytest.skip(f"the default model is not prepared in {embedded.default_model_dir()}; tests never download")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embedded.default_model_dir()))
    for prompt in load_prompts("builtin:long"):
        low, high = BUCKETS[prompt.category]
        count = len(chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt.turns[0]}]))
        assert low <= count <= high, f"{prompt.question_id}: {count} tokens, outside {prompt.category}"


def test_the_licence_texts_ship_with_the_prompt_sets():
    """BSD and MIT ask copies to carry their notices, Apache-2.0 its text: the package data takes data/README.md
    (which holds the BSD and MIT texts and the NOTICE lines) and the Apache text beside the sets."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["jointspec"]
    data = root / "src" / "jointspec" / "data"
    shipped = {path.relative_to(data.parent).as_posix() for path in data.iterdir()
               if any(fnmatch.fnmatch(path.relative_to(data.parent).as_posix(), p) for p in patterns)}
    assert {"data/README.md", "data/LICENSE-Apache-2.0.txt", "data/long.jsonl"} <= shipped, shipped
    readme = (data / "README.md").read_text()
    assert "Permission is hereby granted" in readme and "Redistribution and use in source and binary forms" in readme
    apache = (data / "LICENSE-Apache-2.0.txt").read_text()
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in apache
