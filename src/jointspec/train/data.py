"""Self-distillation data: the target answers training prompts, then its features on those answers are saved.

Two stages, both resumable (each shard is written atomically and skipped when it already exists):

1. **generate**: the target answers every prompt greedily with the batched engine (:mod:`jointspec.batch.engine`),
   so the drafter learns the text the target will actually produce (DistillSpec's on-policy point, in its simplest
   form).
   Prompts that come with a given answer (e.g. ShareGPT's, :mod:`jointspec.train.sharegpt`) skip this stage; with
   ``answers_from`` an OpenAI-compatible server writes the answers (:mod:`jointspec.train.server_answers`);
2. **featurise**: one teacher-forced forward of the target over each prompt + answer saves, per token, the token id
   and the target's last hidden state after the final norm (the *feature*; the target's logits are
   ``lm_head(feature)``, so they need not be stored). Features are kept in float16 to halve the disk footprint.

A data folder holds ``data.json`` (what was generated, for which target) and ``shard-NNNNN.pt`` files, each a dict
``{"token_ids": [T] long, "features": [T, hidden] float16, "starts": [S + 1] long, "answer_starts": [S] long}``:
sequence ``s`` is ``token_ids[starts[s]:starts[s + 1]]``, and its answer begins at offset ``answer_starts[s]``.
A folder built with ``fuse_layers`` (for heads that fuse several of the target's layers, EAGLE-3 style) also holds
``"fuse_features": [T, len(fuse_layers) * hidden] float16``: the target's hidden states at those indices of
``hidden_states`` (0 is the embedding output, ``i`` the output of decoder layer ``i``), side by side.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from jointspec.backends.hf import CausalLM
from jointspec.batch.engine import BatchRequest
from jointspec.batch.lockstep import engine_for
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.files import cannot_write, replacing
from jointspec.core.loop import DecodeConfig
from jointspec.drafts.artifact import target_fingerprint
from jointspec.train.server_answers import AnswerServer, ServerAnswers

log = logging.getLogger(__name__)

DATA_FORMAT = 1


@dataclass(frozen=True)
class DataSpec:
    """What a data folder holds; a folder whose spec differs is refused rather than silently mixed."""

    target_fingerprint: str
    prompts_sha256: str
    num_prompts: int
    max_new_tokens: int
    max_length: int
    shard_size: int
    format: int = DATA_FORMAT
    fuse_layers: tuple[int, ...] = ()
    answers_by: str = "target"  # or "int4" / "int8": a quantised copy of the target; "server": answers_from

    def as_json(self) -> dict:
        """What ``data.json`` holds; folders without fused layers or with the target's own answers keep the keys
        they always had."""
        spec = json.loads(json.dumps(asdict(self)))
        if not self.fuse_layers:
            del spec["fuse_layers"]
        if self.answers_by == "target":
            del spec["answers_by"]
        return spec


def check_fuse_layers(fuse_layers, num_layers: int) -> tuple[int, ...]:
    """``fuse_layers`` as a sorted tuple of hidden-state indices of a target with ``num_layers`` decoder layers."""
    layers = tuple(sorted(set(int(layer) for layer in fuse_layers)))
    bad = [layer for layer in layers if not 0 <= layer < num_layers]
    if bad:
        raise UnsupportedOptionError(f"fuse layers {list(bad)} are out of range: the target has {num_layers} decoder "
                                     f"layers, so pick hidden-state indices 0..{num_layers - 1} (its last layer's "
                                     "output, after the final norm, is always used)")
    return layers


def _prompts_sha256(prompts: list[list[int]], answers: list[list[int] | None] | None = None) -> str:
    # Folders of generated answers only keep the hash they always had; given answers are part of what was built.
    given = answers is not None and any(a is not None for a in answers)
    return hashlib.sha256(json.dumps([prompts, answers] if given else prompts).encode()).hexdigest()


# What a data build that could not write a file (a full disk) leaves, and how to go on.
DATA_KEPT = "the files written before are kept: free some room and run the same command again to go on from them"


def atomic_save(obj, path: Path) -> None:
    with replacing(path, "training data", DATA_KEPT) as tmp:
        torch.save(obj, tmp)


def _shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:05d}.pt"


def _progress(total: int, desc: str, enabled: bool = True):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; keep working without it
        return None
    return tqdm(total=total, desc=desc, unit="prompt")


@torch.inference_mode()
def _featurise(target: CausalLM, sequences: list[list[int]], answer_starts: list[int],
               fuse_layers: tuple[int, ...] = ()) -> dict:
    """One teacher-forced forward per sequence; returns the shard dict described in the module docstring."""
    token_ids: list[torch.Tensor] = []
    features: list[torch.Tensor] = []
    fused: list[torch.Tensor] = []
    for ids in sequences:
        out = target.model(input_ids=torch.tensor([ids], device=target.device), output_hidden_states=True,
                           logits_to_keep=1, use_cache=False)
        features.append(out.hidden_states[-1][0].to("cpu", torch.float16))  # [T, hidden], after the final norm
        if fuse_layers:
            fused.append(torch.cat([out.hidden_states[layer][0] for layer in fuse_layers], -1).to("cpu", torch.float16))
        token_ids.append(torch.tensor(ids, dtype=torch.long))
    lengths = torch.tensor([0] + [len(ids) for ids in sequences])
    shard = {"token_ids": torch.cat(token_ids), "features": torch.cat(features),
             "starts": torch.cumsum(lengths, 0), "answer_starts": torch.tensor(answer_starts, dtype=torch.long)}
    if fuse_layers:
        shard["fuse_features"] = torch.cat(fused)
    return shard


def build_data(target: CausalLM, tokenizer, prompts: list[list[int]], folder: str | Path, *,
               max_new_tokens: int = 256, max_length: int = 1024, shard_size: int = 32, batch_size: int = 16,
               eos_token_ids: frozenset[int] = frozenset(), answers: list[list[int] | None] | None = None,
               fuse_layers: tuple[int, ...] = (), answer_quantize: str = "none",
               answers_from: AnswerServer | None = None, progress: bool = True) -> Path:
    """Generate answers and features for ``prompts`` (token ids, chat template applied) into ``folder``.

    ``answers``: per prompt, either ``None`` (the target answers it) or the token ids of a given answer, which is
    featurised as it is (cut to ``max_new_tokens``) without generating: off-policy text, but a forward instead of a
    decode per token.

    ``fuse_layers``: also keep the target's hidden states at these indices (for heads that fuse them).

    ``answer_quantize``: ``int4`` / ``int8`` write the answers with a quantised copy of the target (faster than float32
    on CPUs, and its greedy text is meant to match float32's; docs/training.md has the measurement);
    features and everything trained on still come from ``target`` itself. ``none``: the target answers.

    ``answers_from``: an OpenAI-compatible server writes the answers instead
    (:mod:`jointspec.train.server_answers`: fetched first, concurrently, kept in the folder as they arrive, and
    only from a server that passes the same-model check); features and labels still come from ``target``.

    Resumes: shards already on disk are kept. A folder made for another target or prompt list is refused.
    """
    folder = Path(folder)  # made when the first file is written: a refused or failed start leaves nothing behind
    if answers is not None and len(answers) != len(prompts):
        raise ValueError(f"{len(answers)} answers for {len(prompts)} prompts")
    max_length = min(max_length, target.max_context)  # (a model of a shorter context: its prompt and answer fit it)
    prompts = [p[: max_length - 1] for p in prompts]
    answers = answers if answers is not None else [None] * len(prompts)

    def budget(prompt: list[int]) -> int:
        return max(1, min(max_new_tokens, max_length - len(prompt)))

    answers = [None if a is None else list(a[:budget(p)]) for p, a in zip(prompts, answers)]
    fuse_layers = check_fuse_layers(fuse_layers, target.config.num_hidden_layers)
    if answer_quantize not in ("none", "int8", "int4"):
        raise UnsupportedOptionError(f"answer_quantize must be none, int8 or int4, got '{answer_quantize}'")
    if answers_from is not None and answer_quantize != "none":
        raise UnsupportedOptionError(f"--answer-quantize {answer_quantize} picks a local copy to write the answers, "
                                     "but --answers-from has a server write them; give one of the two")
    answers_by = "server" if answers_from is not None else "target" if answer_quantize == "none" else answer_quantize
    spec = DataSpec(target_fingerprint(target), _prompts_sha256(prompts, answers), len(prompts), max_new_tokens,
                    max_length, shard_size, fuse_layers=fuse_layers, answers_by=answers_by)
    # With a server, a new folder is begun only once the server passed its same-model check.
    spec = _open_folder(folder, spec, write=answers_from is None)
    if answers_from is not None:  # from here on the server's answers are featurised as given answers are
        fetched = _answers_from_server(answers_from, target, tokenizer, folder, spec, prompts, answers, shard_size,
                                       budget, eos_token_ids, progress)
        answers = [fetched.get(i, answer) for i, answer in enumerate(answers)]
    fuse_layers = spec.fuse_layers

    num_shards = (len(prompts) + shard_size - 1) // shard_size
    bar = _progress(len(prompts), "self-distillation data", progress)
    engine = None  # built on the first shard that needs answers: a finished folder costs no copy
    for index in range(num_shards):
        chunk = prompts[index * shard_size:(index + 1) * shard_size]
        chunk_answers = answers[index * shard_size:(index + 1) * shard_size]
        path = _shard_path(folder, index)
        if not path.exists():
            to_generate = [i for i, a in enumerate(chunk_answers) if a is None]
            requests = [BatchRequest(tuple(chunk[i]), DecodeConfig(max_new_tokens=budget(chunk[i]),
                                                                   eos_token_ids=eos_token_ids))
                        for i in to_generate]
            if requests and engine is None:
                # On jointspec's compiled layers (an int4 or int8 copy) the lockstep engine: every answer is the
                # one `generate` gives, with the weights read once a round for the whole batch.
                engine = engine_for(_answer_model(target, answer_quantize), tokenizer, max_batch_size=batch_size)
            started = time.perf_counter()
            generated = dict(zip(to_generate, engine.generate(requests) if requests else []))
            if requests:  # the answers are most of a build's time: worth a line at JOINTSPEC_LOG=INFO
                log.info("shard %d: %d answers in %.1f s", index, len(requests), time.perf_counter() - started)
            sequences = [list(p) + list(a if a is not None else generated[i])
                         for i, (p, a) in enumerate(zip(chunk, chunk_answers))]
            atomic_save(_featurise(target, sequences, [len(p) for p in chunk], fuse_layers), path)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return folder


def _answers_from_server(server: AnswerServer, target: CausalLM, tokenizer, folder: Path, spec: DataSpec,
                         prompts: list[list[int]], answers: list[list[int] | None], shard_size: int, budget,
                         eos_token_ids: frozenset[int], progress: bool) -> dict[int, list[int]]:
    """The server's answers to every prompt that an unwritten shard needs, by prompt index. All are fetched before
    any featurising: the server works while nothing here waits on it, and an interruption loses no answer (they are
    kept in the folder as they arrive)."""
    wanted = [i for i in range(len(prompts))
              if answers[i] is None and not _shard_path(folder, i // shard_size).exists()]
    fetcher = ServerAnswers(server, target, tokenizer, folder, [prompts[i] for i in wanted],
                            [budget(prompts[i]) for i in wanted], eos_token_ids, progress)
    fetcher.prepare()  # the same-model check
    _open_folder(folder, spec)
    return dict(zip(wanted, fetcher.fetch()))


def _open_folder(folder: Path, spec: DataSpec, write: bool = True) -> DataSpec:
    """Record ``spec`` in a new folder (unless ``write`` is false), or check that an existing one was begun with it;
    the spec to finish with."""
    meta_path = folder / "data.json"
    if not meta_path.exists():
        if write:  # atomically, as the shards: a folder is begun with its whole spec or not at all
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise cannot_write("the data folder", folder, error) from error
            with replacing(meta_path, "the data folder's record", DATA_KEPT) as tmp:
                tmp.write_text(json.dumps(spec.as_json(), indent=1))
        return spec
    try:
        existing = json.loads(meta_path.read_text())
    except ValueError as error:
        raise UnsupportedOptionError(f"'{meta_path}' is damaged ({error}); use a new --data folder or delete this "
                                     "one") from None
    if not spec.fuse_layers and existing.get("fuse_layers"):
        # A folder with fused layers serves drafts that read only the last feature too: finish it as begun.
        spec = replace(spec, fuse_layers=tuple(existing["fuse_layers"]))
    wanted = spec.as_json()
    if existing != wanted:
        differing = sorted(key for key in existing.keys() | wanted.keys() if existing.get(key) != wanted.get(key))
        said = ", ".join(f"{key}: {existing.get(key)!r} there, {wanted.get(key)!r} now" for key in differing)
        raise UnsupportedOptionError(
            f"data folder '{folder}' was built with different settings ({said}); use a new --data folder "
            "or delete this one")
    return spec


def _answer_model(target: CausalLM, answer_quantize: str) -> CausalLM:
    if answer_quantize == "none":
        return target
    from jointspec.backends.loading import quantized_copy

    return quantized_copy(target, answer_quantize)


def load_shards(folder: str | Path) -> Iterator[dict]:
    folder = Path(folder)
    paths = sorted(folder.glob("shard-*.pt"))
    if not paths:
        raise UnsupportedOptionError(f"data folder '{folder}' has no shards; build it first (train-draft does)")
    for path in paths:
        try:
            shard = torch.load(path, weights_only=True)
        except (RuntimeError, EOFError, ValueError) as error:  # written atomically: damaged from outside
            why = " ".join(str(error).split())[:200]
            raise UnsupportedOptionError(
                f"data shard '{path}' is damaged ({why}); delete it and run train-draft with --data '{folder}' again, "
                "which makes the missing shards") from None
        yield shard


def read_spec(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "data.json").read_text())
