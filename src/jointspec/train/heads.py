"""Training an EAGLE-style feature head on self-distillation data (see :mod:`jointspec.drafts.eagle`).

Each training position ``t`` of a sequence feeds ``(feature_t, token_{t+1})`` and asks for ``feature_{t+1}``. Two
losses, as in EAGLE: a smooth-L1 regression onto the true feature, and a cross-entropy between the target's and the
head's next-token distributions over the draft vocabulary (the target's distribution is ``lm_head(feature_{t+1})``,
recomputed on the fly rather than stored).

**Unrolling** (``unroll=2``, after EAGLE-3's training-time test): drafting past the first token feeds the head its
own predicted features, which are never exactly the target's. A second pass therefore reads the first pass's
predictions in place of the true input features and is trained on the same targets, so the head learns to draft
from its own outputs. **Noise** on the input features (EAGLE-1) serves the same purpose more cheaply.

**Fused features** (``fuse_layers``, see :mod:`jointspec.drafts.eagle`): the data folder must hold the target's
hidden states at those indices; batches then carry them beside the last feature (``features`` is
``[batch, length, hidden * (1 + len(fuse_layers))]``, the last feature first), and the head's ``fuse`` makes its
input from them. Losses and the target's argmax read the last feature only.

**VocabTrim**: the draft vocabulary is the ``draft_vocab_size`` tokens the target emits most often in the data (its
argmax at every position). Drafting then costs a ``hidden x draft_vocab`` matmul instead of ``hidden x vocab``.

Held-out evaluation reports, on the answers only (what the head will draft), at depth 1 and 2, how often the head's
argmax equals the target's (teacher-forced; depth 2 reads predicted features), plus the share of the target's answer
tokens the draft vocabulary covers.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.files import WriteError, replacing
from jointspec.drafts.artifact import HeadConfig, float_lm_weight, target_fingerprint
from jointspec.drafts.eagle import EagleHead
from jointspec.train.data import atomic_save, load_shards, read_spec

log = logging.getLogger(__name__)

# What a run that could not write its head or checkpoint (a full disk) leaves, and how to go on.
RESUME = ("the head and checkpoint written before (if any) are kept: free some room and run the same command again "
          "to resume from that checkpoint")


@dataclass(frozen=True)
class TrainConfig:
    """Settings every trained draft shares (the data split, the schedule, evaluation and stopping)."""

    draft_vocab_size: int | None = 8192  # None: full vocabulary
    num_layers: int = 1
    epochs: int = 8
    max_minutes: float | None = None
    batch_tokens: int = 4096
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    eval_fraction: float = 0.05
    eval_every: int = 200
    patience: int = 4  # evaluations without improvement before stopping early
    seed: int = 0

    def __post_init__(self) -> None:
        if self.draft_vocab_size is not None and self.draft_vocab_size < 2:
            raise ValueError(f"draft_vocab_size must be >= 2 or None, got {self.draft_vocab_size}")
        if self.epochs < 1 or self.batch_tokens < 16 or self.learning_rate <= 0:
            raise ValueError(f"bad training settings: epochs {self.epochs}, batch_tokens {self.batch_tokens}, "
                             f"learning_rate {self.learning_rate}")


@dataclass(frozen=True)
class HeadTrainConfig(TrainConfig):
    unroll: int = 2
    noise: float = 0.05  # uniform noise on input features, relative to their RMS
    cls_weight: float = 0.3
    cls_fraction: float = 0.25  # share of positions that pay for the LM-head loss each step (it dominates the cost)
    fuse_layers: tuple[int, ...] = ()  # the target's hidden states fused into the head's input (EAGLE-3 style)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.unroll not in (1, 2, 3):
            raise ValueError(f"unroll must be 1, 2 or 3, got {self.unroll}")
        if not 0 < self.cls_fraction <= 1:
            raise ValueError(f"cls_fraction must be in (0, 1], got {self.cls_fraction}")


@dataclass
class EvalResult:
    step: int
    agreement: list[float]  # per depth: head argmax == target argmax
    loss: float
    vocab_coverage: float

    def line(self) -> str:
        depths = " ".join(f"d{i + 1} {a:.3f}" for i, a in enumerate(self.agreement))
        return (f"step {self.step}: held-out agreement {depths}, loss {self.loss:.4f}, "
                f"coverage {self.vocab_coverage:.3f}")


@dataclass
class TrainResult:
    best: EvalResult | None
    history: list[EvalResult] = field(default_factory=list)
    seconds: float = 0.0
    num_train_tokens: int = 0
    stopped_early: bool = False


def check_data_folders(folders: list[Path], fingerprint: str) -> None:
    """Refuse folders that are no finished data folder, were built for another target, or are named twice (their
    sequences would be trained on twice and could land on both sides of the held-out split)."""
    seen: set[Path] = set()
    for folder in folders:
        if not (folder / "data.json").is_file():
            raise UnsupportedOptionError(f"'{folder}' is not a data folder (no data.json); build one with "
                                         "train-draft --data DIR --data-only")
        spec = read_spec(folder)
        if spec.get("target_fingerprint") != fingerprint:
            raise UnsupportedOptionError(f"data folder '{folder}' was built for another target (fingerprint "
                                         f"{spec.get('target_fingerprint')}, this target's is {fingerprint}); build "
                                         "data for this target")
        num_shards = -(-spec["num_prompts"] // spec["shard_size"])
        if len(list(folder.glob("shard-*.pt"))) < num_shards:
            raise UnsupportedOptionError(f"data folder '{folder}' is unfinished (fewer than its {num_shards} "
                                         "shards); run the same train-draft --data-only command again to finish it")
        if folder.resolve() in seen:
            raise UnsupportedOptionError(f"data folder '{folder}' is named twice (--data and --extra-data?)")
        seen.add(folder.resolve())


def _sequences(folders: list[Path], fuse_layers: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(token ids [T], features [T, hidden], offset where the target's answer begins) per sequence.

    ``fuse_layers``: features are [T, hidden * (1 + len(fuse_layers))], the last feature first, then the target's
    hidden states at those indices (the folders must hold them: built with at least these ``fuse_layers``).
    """
    sequences = []
    for folder in folders:
        stored = tuple(read_spec(folder).get("fuse_layers", ()))
        missing = [layer for layer in fuse_layers if layer not in stored]
        if missing:
            raise UnsupportedOptionError(f"data folder '{folder}' holds the target's hidden states at layers "
                                         f"{list(stored) or 'none'}, not at {missing}; build a data folder with "
                                         f"--fuse-layers {','.join(map(str, fuse_layers))} (and --data-only)")
        columns = [stored.index(layer) for layer in fuse_layers]
        for shard in load_shards(folder):
            features = shard["features"]
            if columns:
                fused = shard["fuse_features"].unflatten(-1, (len(stored), features.shape[1]))[:, columns]
                features = torch.cat([features, fused.flatten(-2)], -1)
            starts = shard["starts"].tolist()
            for (a, b), answer in zip(zip(starts, starts[1:]), shard["answer_starts"].tolist()):
                if b - a >= 3:
                    sequences.append((shard["token_ids"][a:b], features[a:b], answer))
    return sequences


ARGMAX_FILE = "target-argmax.pt"


def _folder_argmax(folder: Path, sequences, lm_weight: torch.Tensor, compute: bool) -> list[torch.Tensor] | None:
    """The target's argmax at every position of each of ``folder``'s ``sequences`` (its :func:`_sequences`), kept
    in the folder once computed: it costs a full-vocabulary matmul per token (minutes for a million tokens on a
    small CPU) and every later run on the folder, of any kind of draft, needs the same. None if it is not kept
    yet and ``compute`` is False. A data folder never changes once built (its spec is checked), so neither does this.
    """
    path = folder / ARGMAX_FILE
    if path.is_file():
        kept = torch.load(path, weights_only=True)
        if len(kept) == len(sequences) and all(len(k) == len(s[0]) for k, s in zip(kept, sequences)):
            return [k.long() for k in kept]
        log.warning("ignoring %s: it does not match the folder's sequences", path)
    if not compute:
        return None
    argmax = [_target_argmax(features, lm_weight) for _, features, _ in sequences]
    atomic_save([a.to(torch.int32) for a in argmax], path)
    return argmax


@torch.no_grad()
def _target_argmax(features: torch.Tensor, lm_weight: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """The target's next-token argmax at every feature row ([T] long), computed in chunks (fused hidden states
    beside the last feature are not read)."""
    out = []
    for i in range(0, features.shape[0], chunk):
        out.append((features[i:i + chunk, :lm_weight.shape[1]].float() @ lm_weight.T).argmax(-1))
    return torch.cat(out)


def choose_draft_vocab(labels: torch.Tensor, vocab_size: int, size: int | None,
                       always: list[int] = (), background: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` most frequent target argmax tokens in ``labels`` (sorted ids), plus ``always`` (e.g. EOS).

    Tokens the data never shows are ranked by ``background`` counts (e.g. the target's argmax on prompt text), then
    by id: BPE vocabularies number their merges roughly in order of frequency, so low ids are the common ones.
    """
    if size is None or size >= vocab_size:
        return torch.arange(vocab_size)
    score = torch.bincount(labels, minlength=vocab_size).double()
    if background is not None:
        score += 1e-3 * torch.bincount(background, minlength=vocab_size).double()
    score += 1e-6 * (1 - torch.arange(vocab_size, dtype=torch.double) / vocab_size)
    score[torch.tensor(list(always), dtype=torch.long)] = float("inf")
    return torch.sort(torch.topk(score, size).indices).values


def held_out_split(token_ids: list[torch.Tensor], fraction: float) -> tuple[list[int], list[int]]:
    """(held-out, training) indices of sequences given by their token ids, chosen by content: a sequence is held
    out when a hash of its tokens falls under ``fraction`` (at least one is held out and one kept).

    Why by content and not by a seeded shuffle of the pool: a shuffle holds out other sequences whenever the pool
    changes, so a head warm-started on a grown pool (``--init`` with ``--extra-data``) was evaluated on sequences it
    had been trained on the run before. Measured when that happened (stage 6, training.md): the starting head scored
    54.4 % held-out agreement, every later evaluation 53.4-53.6 %, so early stopping kept the starting head, while on
    MT-Bench answers (never trained on) the weights 200 steps on agreed about as well (44.6 % against 44.2 %). By
    content, a sequence held out once is held out in every run on every pool that has it, the same text in two
    folders included."""

    def unit(tokens: torch.Tensor) -> float:
        digest = hashlib.sha256(tokens.to(torch.int64).numpy().tobytes()).digest()
        return int.from_bytes(digest[:8], "big") / 2 ** 64

    units = [unit(tokens) for tokens in token_ids]
    held = [i for i, u in enumerate(units) if u < fraction]
    if not held:
        held = [min(range(len(units)), key=units.__getitem__)]
    if len(held) == len(units):
        held.remove(max(held, key=units.__getitem__))
    chosen = set(held)
    return held, [i for i in range(len(units)) if i not in chosen]


def _batches(sequences, batch_tokens: int, rng: random.Random):
    """Groups of similar-length sequences with at most ``batch_tokens`` padded tokens."""
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i][0]), rng.random()))
    groups, group, longest = [], [], 0
    for i in order:
        n = len(sequences[i][0])
        if group and max(longest, n) * (len(group) + 1) > batch_tokens:
            groups.append(group)
            group, longest = [], 0
        group.append(i)
        longest = max(longest, n)
    if group:
        groups.append(group)
    rng.shuffle(groups)
    return groups


def _collate(sequences, group, labels_of, device, answers_only: bool = False):
    """Padded batch; labels are -1 on padding (and on prompt positions when ``answers_only``).

    ``labels_of=None`` (training batches): real positions get label 0. Training losses read the target's
    distribution from the features and use labels only to tell real positions from padding; only the hit counts
    of an evaluation read their values.
    """
    length = max(len(sequences[i][0]) for i in group)
    hidden = sequences[group[0]][1].shape[1]
    tokens = torch.zeros(len(group), length, dtype=torch.long)
    features = torch.zeros(len(group), length, hidden)
    labels = torch.full((len(group), length), -1, dtype=torch.long)
    for row, i in enumerate(group):
        ids, feats, answer = sequences[i]
        tokens[row, :len(ids)] = ids
        features[row, :len(ids)] = feats.float()
        labels[row, :len(ids)] = labels_of[i] if labels_of is not None else 0
        if answers_only:  # label t is the target's choice for token t + 1: the answer's tokens start at answer - 1
            labels[row, :max(0, answer - 1)] = -1
    return tokens.to(device), features.to(device), labels.to(device)


# When to stop does not change what a step computes: a run stopped by them resumes under other values (a longer
# --max-minutes, more --patience) instead of starting over.
_STOPPING_RULES = ("patience", "max_minutes")


def _trajectory(settings: dict) -> dict:
    """The training settings that decide the weights after each step."""
    return {k: v for k, v in settings.items() if k not in _STOPPING_RULES}


class HeadTrainer:
    """Trains one head for one target; checkpoints to ``folder/checkpoint.pt`` and resumes from it."""

    def __init__(self, target: CausalLM, config: TrainConfig, eos_token_ids: frozenset[int] = frozenset()):
        self.target = target
        self.config = config
        self.eos_token_ids = eos_token_ids
        # Drafts train on the CPU whatever device the target runs on (the data folders hold CPU features): a target on
        # another device lends CPU float copies of its LM head and input embedding.
        self.lm_weight_full = float_lm_weight(target.model).detach().float().cpu()
        embed = target.model.get_input_embeddings()
        self.embed = embed if embed.weight.device.type == "cpu" else \
            torch.nn.Embedding.from_pretrained(embed.weight.detach().float().cpu())
        self.fuse_layers = tuple(getattr(config, "fuse_layers", ()))

    # What is trained: subclasses train other kinds of draft with the same data, schedule and checkpoints.
    config_class = HeadConfig
    module_class = EagleHead

    def _new_config(self, draft_vocab_size: int | None):
        """The shape of a draft trained from scratch for this target."""
        extra = {"fuse_layers": self.fuse_layers} if self.fuse_layers else {}
        return self.config_class.for_target(self.target, target_fingerprint(self.target),
                                            num_layers=self.config.num_layers, draft_vocab_size=draft_vocab_size,
                                            **extra)

    def _initialise(self, head: EagleHead) -> None:
        """Starting weights of a draft trained from scratch (a head keeps its random initialisation)."""

    def _train_loss(self, head: EagleHead, tokens, features, labels, draft_weight, draft_index,
                    generator: torch.Generator) -> torch.Tensor:
        """The loss of one training batch (``labels`` only mark real positions, see :func:`_collate`)."""
        outputs = self._passes(head, tokens, features, generator, self.config.noise)
        loss, _, _ = self._loss(outputs, features, labels, draft_weight, draft_index, generator,
                                self.config.cls_fraction)
        return loss

    def _passes(self, head: EagleHead, tokens, features, generator: torch.Generator | None, noise: float):
        """Predicted features of every pass: [unroll] x [batch, length - 1, hidden]."""
        batch, length, _ = features.shape
        fused = head.fuse(features)  # [batch, length, hidden]
        inputs = fused[:, :-1]
        embeds = self.embed(tokens[:, 1:]).float()
        positions = torch.arange(length - 1, device=features.device)[None].expand(batch, -1)
        outputs = []
        for _ in range(self.config.unroll):
            if noise > 0:
                scale = inputs.detach().pow(2).mean().sqrt() * noise
                inputs = inputs + (torch.rand(inputs.shape, generator=generator, device=inputs.device) * 2 - 1) * scale
            predicted = head(inputs, embeds, position_ids=positions)
            outputs.append(predicted)
            # The next pass reads, at position t, the prediction of feature t (made at t - 1).
            inputs = torch.cat([fused[:, :1], predicted[:, :-1]], dim=1)
        return outputs

    def _loss(self, outputs, features, labels, draft_weight, draft_index, generator=None, cls_fraction=1.0):
        """Weighted loss over passes, argmax hits per pass, number of scored positions."""
        targets = features[:, 1:, :draft_weight.shape[1]]  # the last feature (fused hidden states follow it)
        valid = labels[:, 1:] >= 0  # [batch, length - 1]
        # The LM-head loss costs a hidden x draft-vocab matmul per position (most of a step): pay it on a sample.
        scored = valid.nonzero()
        if cls_fraction < 1.0:
            keep = torch.rand(scored.shape[0], generator=generator) < cls_fraction
            scored = scored[keep]
        rows_b, rows_t = scored[:, 0], scored[:, 1]
        with torch.no_grad():
            teacher = F.softmax(targets[rows_b, rows_t] @ draft_weight.T, dim=-1)
            wanted = draft_index[labels[:, 1:][rows_b, rows_t]]
        total, per_depth = 0.0, []
        for depth, predicted in enumerate(outputs):
            regression = F.smooth_l1_loss(predicted[valid], targets[valid])
            logprobs = F.log_softmax(predicted[rows_b, rows_t] @ draft_weight.T, dim=-1)
            classification = -(teacher * logprobs).sum(-1).mean()
            weight = 1.0 if depth == 0 else 0.5
            total = total + weight * (regression + self.config.cls_weight * classification)
            with torch.no_grad():
                per_depth.append(((logprobs.argmax(-1) == wanted) & (wanted >= 0)).float().sum().item())
        return total, per_depth, int(scored.shape[0])

    def train(self, data_folder: str | Path | list[str | Path], out_folder: str | Path, progress: bool = True,
              provenance: dict | None = None, init: EagleHead | None = None) -> tuple[EagleHead, TrainResult]:
        """Train on ``data_folder`` (or several, pooled); save the best head and a resumable checkpoint in
        ``out_folder``.

        The saved ``draft.json`` records the training settings and ``provenance`` (the command line, say) next to
        the best evaluation, so an artifact says how to make it again. ``init``: start from this head's weights,
        shape and draft vocabulary (``config.draft_vocab_size`` is then not used) rather than from scratch; the
        first evaluation happens before any step, so the saved head is never worse on held-out data than ``init``.
        """
        self._check_init(init)
        config = self.config
        out_folder = Path(out_folder)
        out_folder.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(config.seed)  # parameter init of the head; all later randomness uses explicit generators
        data = self._training_data(data_folder, init)
        head = self._starting_head(init, data.vocab)
        run = _Run(trainer=self, head=head, data=data, out_folder=out_folder, provenance=provenance or {},
                   init=init, progress=progress)
        try:
            run.train_epochs()
        finally:
            run.close()
        history = [EvalResult(**h) for h in run.state["history"]]
        best = EvalResult(**run.state["best"]) if run.state["best"] else None
        return head, TrainResult(best=best, history=history, seconds=time.perf_counter() - run.started,
                                 num_train_tokens=sum(len(s[0]) for s in data.train_seqs),
                                 stopped_early=run.state["bad_evals"] >= config.patience)

    def _check_init(self, init: EagleHead | None) -> None:
        if init is not None and not isinstance(init, self.module_class):
            raise UnsupportedOptionError(f"the draft to start from is a '{init.config.kind}' draft; this trains "
                                         f"'{self.config_class.kind}' drafts (match --init to --kind)")
        if init is not None and init.config.num_layers != self.config.num_layers:
            raise UnsupportedOptionError(f"the head to start from has {init.config.num_layers} layer(s), the "
                                         f"settings ask for {self.config.num_layers}; pass --layers "
                                         f"{init.config.num_layers}")

    def _training_data(self, data_folder: str | Path | list[str | Path], init: EagleHead | None) -> _TrainingData:
        """The pooled sequences, split into training and held-out ones, and the draft vocabulary."""
        config = self.config
        folders = [Path(f) for f in (data_folder if isinstance(data_folder, list) else [data_folder])]
        check_data_folders(folders, target_fingerprint(self.target))
        per_folder = [_sequences([folder], self.fuse_layers) for folder in folders]
        sequences = [sequence for folder_sequences in per_folder for sequence in folder_sequences]
        if len(sequences) < 2:
            raise UnsupportedOptionError(f"data folder(s) {', '.join(map(str, folders))} hold {len(sequences)} "
                                         "usable sequences; generate more data (more prompts)")
        eval_ids, train_ids = held_out_split([tokens for tokens, _, _ in sequences], config.eval_fraction)
        # The target's argmax scores held-out data and chooses a draft vocabulary; training batches do not need it
        # (see _collate), so a warm start, which inherits its vocabulary, computes it for the held-out sequences
        # only, unless the data folders keep it from an earlier run.
        kept = [_folder_argmax(folder, folder_sequences, self.lm_weight_full, compute=init is None)
                for folder, folder_sequences in zip(folders, per_folder)]
        all_argmax = None if any(k is None for k in kept) else [a for k in kept for a in k]
        eval_labels_of = [all_argmax[i] if all_argmax is not None
                          else _target_argmax(sequences[i][1], self.lm_weight_full) for i in eval_ids]
        if init is not None:
            vocab = init.draft_vocab.detach().cpu().clone()
        else:
            # The draft vocabulary follows what the target writes in its answers (what the head will draft).
            train_argmax = [all_argmax[i] for i in train_ids]
            answer_argmax = torch.cat([labels[max(0, sequences[i][2] - 1):] for i, labels in zip(train_ids,
                                                                                                    train_argmax)])
            vocab = choose_draft_vocab(answer_argmax, self.target.vocab_size, config.draft_vocab_size,
                                       sorted(self.eos_token_ids), torch.cat(train_argmax))
        draft_index = torch.full((self.target.vocab_size,), -1, dtype=torch.long)
        draft_index[vocab] = torch.arange(vocab.shape[0])
        return _TrainingData(train_seqs=[sequences[i] for i in train_ids], eval_seqs=[sequences[i] for i in eval_ids],
                             eval_labels_of=eval_labels_of, vocab=vocab, draft_index=draft_index,
                             draft_weight=self.lm_weight_full.index_select(0, vocab))

    def _starting_head(self, init: EagleHead | None, vocab: torch.Tensor) -> EagleHead:
        """A new head over ``vocab``: ``init``'s weights where given (widened to fuse layers if asked), else fresh."""
        head_config = init.config if init is not None else self._new_config(
            None if vocab.shape[0] == self.target.vocab_size else int(vocab.shape[0]))
        init_fuses = head_config.fuse_layers
        if init is not None and init_fuses != self.fuse_layers:
            if init_fuses:
                raise UnsupportedOptionError(f"the head to start from fuses layers {list(init_fuses)}; the settings "
                                             f"ask for {list(self.fuse_layers) or 'none'}: pass --fuse-layers "
                                             f"{','.join(map(str, init_fuses))}")
            # An unfused head starts a fused one: its fuse_fc starts at zero, so it begins as the head it starts from.
            head_config = replace(head_config, fuse_layers=self.fuse_layers)
        head = self.module_class(head_config)
        if init is not None:
            missing, unexpected = head.load_state_dict({k: v.detach().float().cpu()
                                                        for k, v in init.state_dict().items()}, strict=False)
            assert not unexpected and set(missing) <= {"fuse_fc.weight"}, (missing, unexpected)
        else:
            self._initialise(head)
        head.draft_vocab.copy_(vocab)
        head.train()
        return head

    @torch.no_grad()
    def evaluate(self, head: EagleHead, sequences, labels_of, draft_weight, draft_index, step: int) -> EvalResult:
        head.eval()
        hits = [0.0] * self.config.unroll
        total_loss, count, covered = 0.0, 0, 0
        for group in _batches(sequences, self.config.batch_tokens, random.Random(0)):
            tokens, features, labels = _collate(sequences, group, labels_of, "cpu", answers_only=True)
            outputs = self._passes(head, tokens, features, None, 0.0)
            loss, per_depth, num = self._loss(outputs, features, labels, draft_weight, draft_index)
            total_loss += float(loss) * num
            count += num
            hits = [h + d for h, d in zip(hits, per_depth)]
            valid = labels[:, 1:] >= 0
            covered += int((draft_index[labels[:, 1:][valid]] >= 0).sum())
        head.train()
        return EvalResult(step=step, agreement=[round(h / max(1, count), 4) for h in hits],
                          loss=round(total_loss / max(1, count), 4), vocab_coverage=round(covered / max(1, count), 4))


@dataclass
class _TrainingData:
    train_seqs: list
    eval_seqs: list
    eval_labels_of: list
    vocab: torch.Tensor  # [draft vocab] target ids the head drafts
    draft_index: torch.Tensor  # [target vocab] -> position in ``vocab``, -1 outside it
    draft_weight: torch.Tensor  # [draft vocab, hidden] the target's LM head rows of ``vocab``


def _data_digest(data: _TrainingData) -> str:
    """A hash of the training and held-out examples' tokens, in order: what a checkpoint is resumed on."""
    digest = hashlib.sha256()
    for part in (data.train_seqs, data.eval_seqs):
        digest.update(len(part).to_bytes(8, "little"))
        for sequence in part:
            tokens = torch.as_tensor(sequence[0]).to(torch.int64).contiguous()
            digest.update(tokens.numel().to_bytes(8, "little"))
            digest.update(tokens.numpy().tobytes())
    return digest.hexdigest()


class _Run:
    """One training run of a :class:`HeadTrainer`: the optimiser, schedule, checkpoint and best-head bookkeeping."""

    def __init__(self, *, trainer: HeadTrainer, head, data: _TrainingData, out_folder: Path, provenance: dict,
                 init, progress: bool) -> None:
        config = trainer.config
        self.trainer, self.config, self.head, self.data = trainer, config, head, data
        self.out_folder, self.provenance = out_folder, provenance
        self.generator = torch.Generator().manual_seed(config.seed)
        self.optimizer = torch.optim.AdamW([p for n, p in head.named_parameters() if not n.startswith("body.embed")],
                                           lr=config.learning_rate, weight_decay=config.weight_decay)
        self.steps_per_epoch = len(_batches(data.train_seqs, config.batch_tokens, random.Random(0)))
        self.total_steps = self.steps_per_epoch * config.epochs
        self.checkpoint = out_folder / "checkpoint.pt"
        self.data_digest = _data_digest(data)
        self.state = {"step": 0, "best": None, "history": [], "bad_evals": 0, "seconds": 0.0}
        self._resume()
        self.settings = asdict(config)
        if init is not None and getattr(head, "draft_vocab", None) is not None:
            # A warm start keeps its head's vocabulary; record that, not the option it did not use.
            self.settings["draft_vocab_size"] = int(head.draft_vocab.numel())
        self.bar = None
        if progress:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=self.total_steps, initial=self.state["step"],
                            desc=f"train {trainer.config_class.kind} draft", unit="step")
        self.started = time.perf_counter() - self.state["seconds"]
        if init is not None and self.state["step"] == 0 and not self.state["history"]:
            # The starting head is the bar to clear: without this, a run that only made it worse would still save.
            self.evaluate_and_keep_best("start: ")

    def _resume(self) -> None:
        if not self.checkpoint.exists():
            return
        saved = torch.load(self.checkpoint, weights_only=False)
        # The same settings, vocabulary and data (the examples themselves: a full vocabulary is the same on any data).
        if (_trajectory(saved["config"]) == _trajectory(asdict(self.config)) and saved["vocab"].equal(self.data.vocab)
                and saved.get("data_digest") == self.data_digest):
            self.head.load_state_dict(saved["head"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.state = saved["state"]
            self.generator.set_state(saved["generator"])
            log.info("resumed from %s at step %d", self.checkpoint, self.state["step"])
        else:
            log.warning("ignoring %s: it was made with other settings or data", self.checkpoint)

    def learning_rate(self, step: int) -> float:
        """Linear warm-up, then cosine decay to zero over the remaining steps."""
        config = self.config
        if step < config.warmup_steps:
            return config.learning_rate * (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, self.total_steps - config.warmup_steps)
        return config.learning_rate * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def evaluate_and_keep_best(self, prefix: str = "", scheduled: bool = True) -> None:
        """Evaluate, and save the head where it is the best yet. An evaluation off the schedule (the time cap fell
        between two) saves it only where no scheduled one has been kept: a head that beat the scheduled best there
        would stay on disk after a resumed run that an uninterrupted one never saves."""
        data, state = self.data, self.state
        result = self.trainer.evaluate(self.head, data.eval_seqs, data.eval_labels_of, data.draft_weight,
                                       data.draft_index, state["step"])
        state["history"].append(asdict(result))
        # A result, not progress: shown without the bar too (--no-progress hides bars only).
        if self.bar is not None:
            self.bar.write(prefix + result.line(), file=sys.stderr)  # with the bar: stdout ends with JSON
        else:
            print(prefix + result.line(), file=sys.stderr, flush=True)
        if not scheduled and state["best"] is not None:
            return
        if state["best"] is None or result.agreement[0] > state["best"]["agreement"][0]:
            state["best"], state["bad_evals"] = asdict(result), 0
            try:
                self.head.save(self.out_folder, training={"best": state["best"], "settings": self.settings,
                                                          **self.provenance})
            except WriteError as error:
                raise WriteError(f"{error}; {RESUME}") from error.__cause__
        else:
            state["bad_evals"] += 1

    def past_time_cap(self, seconds: float) -> bool:
        """Whether a run that has trained ``seconds`` is past --max-minutes."""
        return self.config.max_minutes is not None and seconds > 60 * self.config.max_minutes

    def stopped_already(self) -> bool:
        """Whether the run resumed from a checkpoint that a stopping rule ended, with that rule unchanged: it trains
        no further step (raise --max-minutes or --patience to go on)."""
        config, state = self.config, self.state
        if state["step"] == 0 or state["step"] >= self.total_steps:
            return False
        timed_out = self.past_time_cap(state["seconds"])
        rules = [rule for rule, stopped in (("--max-minutes", timed_out), ("--patience",
                                                                           state["bad_evals"] >= config.patience))
                 if stopped]
        if rules:
            log.warning("the checkpoint in %s stopped at step %d by %s, unchanged since: nothing to train (raise %s "
                        "to go on)", self.out_folder, state["step"], " and ".join(rules), " and ".join(rules))
            return True
        return False

    def train_epochs(self) -> None:
        if self.stopped_already():
            return
        epoch = self.state["step"] // max(1, self.steps_per_epoch)
        while epoch < self.config.epochs:
            groups = _batches(self.data.train_seqs, self.config.batch_tokens,
                              random.Random(self.config.seed * 1000 + epoch))
            for group in groups[self.state["step"] - epoch * self.steps_per_epoch:]:
                loss = self.step(group)
                if self.bar is not None:
                    self.bar.update(1)
                    self.bar.set_postfix(loss=f"{loss:.3f}")
                if self.after_step():
                    return
            epoch += 1

    def step(self, group) -> float:
        """One optimiser step on one batch; returns its loss."""
        data = self.data
        tokens, features, labels = _collate(data.train_seqs, group, None, "cpu")
        for g in self.optimizer.param_groups:
            g["lr"] = self.learning_rate(self.state["step"])
        loss = self.trainer._train_loss(self.head, tokens, features, labels, data.draft_weight, data.draft_index,
                                        self.generator)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optimizer.step()
        self.state["step"] += 1
        return loss.item()

    def after_step(self) -> bool:
        """Evaluate and checkpoint when due; True when training should stop (patience or time spent)."""
        config, state = self.config, self.state
        timed_out = self.past_time_cap(time.perf_counter() - self.started)
        scheduled = state["step"] % config.eval_every == 0 or state["step"] == self.total_steps
        if not (scheduled or timed_out):
            return False
        # The checkpoint keeps the bookkeeping of the scheduled evaluations only: an evaluation off the schedule,
        # counted towards --patience or kept as the best to beat, made a resumed run end elsewhere than an
        # uninterrupted one.
        kept = copy.deepcopy(state) if not scheduled else None
        self.evaluate_and_keep_best(scheduled=scheduled)
        state["seconds"] = time.perf_counter() - self.started
        if kept is not None:
            kept["seconds"] = state["seconds"]
        checkpoint = {"config": asdict(config), "vocab": self.data.vocab, "data_digest": self.data_digest,
                      "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                      "state": state if kept is None else kept, "generator": self.generator.get_state()}
        with replacing(self.checkpoint, "the training checkpoint", RESUME) as tmp:
            torch.save(checkpoint, tmp)
        return state["bad_evals"] >= config.patience or timed_out

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
