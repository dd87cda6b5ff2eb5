"""Build ``src/jointspec/data/long.jsonl``, the ``builtin:long`` prompt set: long inputs for ``jointspec bench``.

Twelve prompts: for each size bucket (2k, 4k and 7k tokens of SmolLM2-135M-Instruct's tokenizer, chat template
included, as ``jointspec bench`` builds them) one summarise, one qa (answer from the text), one extract and one edit
task. The texts are documentation pages, changelogs and Python source files shipped in the sdists of four permissively
licensed PyPI packages, pinned below by version and sha256; each document is cut at a paragraph or function boundary
so that its prompt lands in its bucket, and the script fails if one does not.

Each line carries the bench's keys (``question_id``, ``category`` = the bucket, ``turns``) plus ``task``, ``tokens``,
``source`` (package, version, path, lines, licence, copyright) and ``reference`` (the expected answer, the items to
extract, or the definitions an edit changes), which the bench ignores.

Run from the repository root (fetches four sdists, about 1.4 MB, with pip; needs the embedded default model's
tokenizer, which ``jointspec generate`` prepares once)::

    python scripts/build_long_prompts.py            # writes src/jointspec/data/long.jsonl and prints a table
    python scripts/build_long_prompts.py --check    # only checks that the file is up to date
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "src" / "jointspec" / "data" / "long.jsonl"

# Bucket: inclusive token range of the whole chat prompt (SmolLM2's template adds its system turn).
BUCKETS = {"2k": (1900, 2100), "4k": (3900, 4100), "7k": (6900, 7100)}


@dataclass(frozen=True)
class Package:
    version: str
    sdist: str
    sha256: str
    licence: str
    copyright: str


PACKAGES = {
    "click": Package("8.1.7", "click-8.1.7.tar.gz",
                     "ca9853ad459e787e2192211578cc907e7594e294c7ccc834310722b41b9ca6de",
                     "BSD-3-Clause", "Copyright 2014 Pallets"),
    "attrs": Package("23.2.0", "attrs-23.2.0.tar.gz",
                     "935dc3b529c262f6cf76e50877d35a4bd3c1de194fd41f47a2b7ae8f19971f30",
                     "MIT", "Copyright (c) 2015 Hynek Schlawack and the attrs contributors"),
    "requests": Package("2.32.3", "requests-2.32.3.tar.gz",
                        "55365417734eb18255590a9ff9eb97e9e1da868d4ccd6402399eaf68af20a760",
                        "Apache-2.0", "Requests, Copyright 2019 Kenneth Reitz"),
    "packaging": Package("24.1", "packaging-24.1.tar.gz",
                         "026ed72c8ed3fcce5bf8950572258698927fd1dbda10a5e981cdf0ac37f4f002",
                         "Apache-2.0 OR BSD-2-Clause",
                         "Copyright (c) Donald Stufft and individual contributors"),
}


@dataclass(frozen=True)
class Item:
    bucket: str
    task: str  # summarise, qa, extract, edit
    name: str  # short source name for the question_id
    package: str
    path: str  # inside the sdist, below its top folder
    question: str = ""  # qa: the question
    answer: str = ""  # qa: the answer, which must occur in the kept text (past its first quarter)
    old: str = ""  # edit: the identifier to rename
    new: str = ""  # edit: its new name


ITEMS = [
    # 2k
    Item("2k", "summarise", "click-arguments", "click", "docs/arguments.rst"),
    Item("2k", "qa", "attrs-why", "attrs", "docs/why.md",
         question="Which library does the text point to for structuring, unstructuring and validating data?",
         answer="cattrs"),
    Item("2k", "extract", "packaging-changelog", "packaging", "CHANGELOG.rst"),
    Item("2k", "edit", "attrs-validators", "attrs", "src/attr/validators.py",
         old="set_run_validators", new="set_validators_enabled"),
    # 4k
    Item("4k", "summarise", "attrs-init", "attrs", "docs/init.md"),
    Item("4k", "qa", "click-commands", "click", "docs/commands.rst",
         question="In a chained multi command, what value does `Context.invoked_subcommand` give when more than "
                  "one subcommand is invoked?",
         answer="'*'"),
    Item("4k", "extract", "requests-cookies", "requests", "src/requests/cookies.py"),
    Item("4k", "edit", "packaging-version", "packaging", "src/packaging/version.py",
         old="_parse_letter_version", new="_parse_letter_and_number"),
    # 7k
    Item("7k", "summarise", "click-options", "click", "docs/options.rst"),
    Item("7k", "qa", "attrs-examples", "attrs", "docs/examples.md",
         question="Which attrs function imitates Clojure's assoc, creating a new instance with some attributes "
                  "changed?",
         answer="attrs.evolve"),
    Item("7k", "extract", "requests-sessions", "requests", "src/requests/sessions.py"),
    Item("7k", "edit", "click-types", "click", "src/click/types.py",
         old="_describe_range", new="describe_range"),
]


# --- fetching -------------------------------------------------------------------------------------------------------

def fetch_sdists(folder: Path) -> dict[str, tarfile.TarFile]:
    """Download each pinned sdist with pip (no dependencies) and check its sha256."""
    archives = {}
    for name, package in PACKAGES.items():
        path = folder / package.sdist
        if not path.is_file():
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            "--dest", str(folder), f"{name}=={package.version}"], check=True)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != package.sha256:
            raise SystemExit(f"{package.sdist}: sha256 {digest}, expected {package.sha256}")
        archives[name] = tarfile.open(path)
    return archives


def read_member(archive: tarfile.TarFile, package: str, path: str) -> list[str]:
    top = PACKAGES[package].sdist[:-len(".tar.gz")]
    handle = archive.extractfile(f"{top}/{path}")
    assert handle is not None, path
    text = handle.read().decode("utf-8").replace("\r\n", "\n")
    return [line.rstrip() for line in text.split("\n")]


# --- cutting --------------------------------------------------------------------------------------------------------

_CODE_START = re.compile(r"^(    )?(def |async def |class |@)")
_RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}$")


def cut_points(lines: list[str], code: bool) -> list[int]:
    """Line counts a document may be cut to: before a (method-level or top-level) def/class for code, before an
    unindented paragraph for prose (never inside a fenced block, nor leaving a heading among the last three lines or
    a line ending in a colon last)."""
    points = []
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if i == 0 or fenced or lines[i - 1].strip() or not line.strip():
            continue
        if code:
            if _CODE_START.match(line):
                points.append(i)
            continue
        if line[0].isspace():
            continue
        kept = [x for x in lines[max(0, i - 12):i] if x.strip()][-3:]
        if any(x.startswith("#") or _RST_UNDERLINE.match(x) for x in kept) or (kept and kept[-1].endswith(":")):
            continue  # would end the document just after a heading, or on a line that introduces what follows
        points.append(i)
    points.append(len(lines))
    return points


def document(lines: list[str], count: int) -> str:
    return "\n".join(lines[:count]).strip("\n")


# --- prompts --------------------------------------------------------------------------------------------------------

def describe(item: Item) -> str:
    package = PACKAGES[item.package]
    return f"the file `{item.path}` from the {item.package} {package.version} package"


def wrap(item: Item, text: str) -> str:
    if item.path.endswith(".py"):
        return f"```python\n{text}\n```"
    return f"<document>\n{text}\n</document>"


def make_turn(item: Item, text: str, whole: bool) -> str:
    body = wrap(item, text)
    source = f"Below is {describe(item)}" + ("" if whole else " (its first part)")
    if item.task == "summarise":
        task = ("Summarise this documentation in one paragraph of about 150 words: what it is about and the main "
                "points a reader should remember.")
        return f"{source}. {task}\n\n{body}\n\n{task}"
    if item.task == "qa":
        task = f"Answer this question using only the documentation above, in one or two sentences: {item.question}"
        return f"{source}. Read it, then answer this question from it: {item.question}\n\n{body}\n\n{task}"
    if item.task == "extract" and item.path.endswith(".py"):
        task = ("List every function and method defined in the code above, in the order they appear, one per line "
                "as `name(parameters)`, copying the parameters exactly as written in its `def` line. "
                "Write nothing else.")
        return f"{source}. Read it, then do the task that follows it.\n\n{body}\n\n{task}"
    if item.task == "extract":
        task = ("List every release in the changelog above, one per line as `version: release date`, newest first. "
                "Write nothing else.")
        return f"{source}. Read it, then do the task that follows it.\n\n{body}\n\n{task}"
    if item.task == "edit":
        task = (f"Rename `{item.old}` to `{item.new}` everywhere in the code above (its definition, every use, and "
                "its docstrings). Then show only the functions, methods or classes that changed, each in full after "
                "the edit, in one python code block. Do not repeat code that did not change.")
        return f"{source}. Read it, then do the task that follows it.\n\n{body}\n\n{task}"
    raise ValueError(item.task)


# --- references -----------------------------------------------------------------------------------------------------

def code_functions(text: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(text)
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append(child)
                continue  # functions nested in functions are local helpers, not "defined in the code"
            if isinstance(child, ast.ClassDef):
                visit(child)

    visit(tree)
    return sorted(found, key=lambda f: f.lineno)


def changed_definitions(text: str, name: str) -> list[str]:
    """Qualified names of the innermost functions and classes whose own lines (decorators and header included,
    nested definitions left out) mention ``name``."""
    pattern = re.compile(rf"\b{re.escape(name)}\b")
    lines = text.split("\n")
    found = []

    def span(node: ast.AST) -> range:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return range(first - 1, node.end_lineno)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            inner = [c for c in ast.walk(child) if c is not child
                     and isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            nested = {i for c in inner for i in span(c)}
            if any(pattern.search(lines[i]) for i in span(child) if i not in nested):
                found.append((span(child).start, prefix + child.name))
            visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(text), "")
    return [qualname for _, qualname in sorted(found)]


def reference(item: Item, text: str) -> str | list[str]:
    if item.task == "qa":
        position = text.find(item.answer)
        assert position >= 0, f"{item.name}: answer {item.answer!r} not in the kept text"
        assert position > len(text) // 4, f"{item.name}: answer {item.answer!r} is in the first quarter"
        return item.answer
    if item.task == "extract" and item.path.endswith(".py"):
        return [f"{f.name}({ast.unparse(f.args)})" for f in code_functions(text)]
    if item.task == "extract":
        releases = re.findall(r"^(\d[\w.]*) - (\d{4}-\d{2}-\d{2})$", text, flags=re.MULTILINE)
        assert releases, item.name
        return [f"{version}: {date}" for version, date in releases]
    if item.task == "edit":
        changed = changed_definitions(text, item.old)
        assert len(changed) >= 2, f"{item.name}: {item.old} occurs in {changed}"
        return changed
    return ""


# --- building -------------------------------------------------------------------------------------------------------

def load_tokenizer():
    sys.path.insert(0, str(ROOT / "src"))
    from transformers import AutoTokenizer

    from jointspec.backends.embedded import prepare_default_model

    return AutoTokenizer.from_pretrained(str(prepare_default_model()))


def build(archives: dict[str, tarfile.TarFile], tokenizer, dump: Path | None = None) -> list[dict]:
    from jointspec.bench.prompts import chat_prompt_ids

    def count(turn: str) -> int:
        return len(chat_prompt_ids(tokenizer, [{"role": "user", "content": turn}]))

    rows = []
    for item in ITEMS:
        low, high = BUCKETS[item.bucket]
        lines = read_member(archives[item.package], item.package, item.path)
        points = cut_points(lines, code=item.path.endswith(".py"))
        # The largest cut whose prompt fits under the bucket's top (token counts grow with the cut).
        best, lo, hi = None, 0, len(points) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if count(make_turn(item, document(lines, points[mid]), points[mid] == len(lines))) <= high:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        assert best is not None, f"{item.name}: even the first cut is over {high} tokens"
        text = document(lines, points[best])
        turn = make_turn(item, text, points[best] == len(lines))
        if dump:
            (dump / f"{item.bucket}-{item.task}-{item.name}.txt").write_text(turn)
        tokens = count(turn)
        assert low <= tokens <= high, f"{item.name}: {tokens} tokens, outside {item.bucket} ({low}-{high})"
        package = PACKAGES[item.package]
        rows.append({
            "question_id": f"long/{item.bucket}/{item.task}-{item.name}",
            "category": item.bucket,
            "turns": [turn],
            "task": item.task,
            "tokens": tokens,
            "source": {"package": item.package, "version": package.version, "path": item.path,
                       "lines": f"1-{text.count(chr(10)) + 1}", "licence": package.licence,
                       "copyright": package.copyright},
            "reference": reference(item, text),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the shipped file differs; write nothing")
    parser.add_argument("--cache", type=Path, help="folder for the downloaded sdists (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.cache or Path(temporary)
        folder.mkdir(parents=True, exist_ok=True)
        rows = build(fetch_sdists(folder), load_tokenizer())
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    print(f"{'question_id':<44} {'tokens':>6}  source (licence)")
    for row in rows:
        source = row["source"]
        print(f"{row['question_id']:<44} {row['tokens']:>6}  {source['package']} {source['version']} "
              f"{source['path']} lines {source['lines']} ({source['licence']})")
    if args.check:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            raise SystemExit(f"{OUT} is out of date: rerun scripts/build_long_prompts.py")
        print(f"{OUT} is up to date")
        return
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {len(rows)} prompts, {len(text.encode()) / 1024:.0f} KB, to {OUT}")


if __name__ == "__main__":
    main()
