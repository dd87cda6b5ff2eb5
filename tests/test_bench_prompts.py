"""Prompt sets for `jointspec bench` (``jointspec.bench.prompts``): SpecBench-style JSONL files load unchanged, the
built-in sets are complete, malformed lines are named by file and line, and selections refuse what they cannot give.

Deterministic: no false-failure odds.
"""

from __future__ import annotations

import json
import re

import pytest

from jointspec.bench.prompts import PromptSetError, load_prompts, select_prompts

from helpers import SPEC_BENCH_LINES


def test_spec_bench_file_loads_unchanged(bench_prompt_file):
    prompts = load_prompts(str(bench_prompt_file))
    assert [p.question_id for p in prompts] == ["1", "2", "c1"]
    assert prompts[0].turns == tuple(SPEC_BENCH_LINES[0]["turns"])  # two turns kept
    assert [p.question_id for p in select_prompts(prompts, ["summary"], 1)] == ["1"]
    assert [len(p.turns) for p in select_prompts(prompts, max_turns=1)] == [1, 1, 1]


@pytest.mark.parametrize("name,count", [("mt_bench", 80), ("humaneval", 164), ("grounded", 16)])
def test_builtin_sets(name, count):
    prompts = load_prompts(f"builtin:{name}")
    assert len(prompts) == count
    assert all(p.turns and p.category for p in prompts)


@pytest.mark.parametrize("line,message", [
    ('{"question_id": 1, "category": "x", "turns": ["ok"]', "not valid JSON"),
    ('{"question_id": 1, "turns": ["ok"]}', "missing key(s) category"),
    ('{"question_id": 1, "category": "x", "turns": []}', "'turns' must be a non-empty list"),
    ('[1, 2]', "expected a JSON object"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(SPEC_BENCH_LINES[0]) + "\n" + line + "\n")
    with pytest.raises(PromptSetError, match=rf"bad\.jsonl:2: .*{re.escape(message)}"):
        load_prompts(str(path))


def test_empty_selection_and_unknown_category(bench_prompt_file, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PromptSetError, match="empty"):
        select_prompts(load_prompts(str(empty)))
    with pytest.raises(PromptSetError, match="unknown category nope; this prompt set has: summary, code"):
        select_prompts(load_prompts(str(bench_prompt_file)), ["nope"])
