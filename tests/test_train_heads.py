"""Training EAGLE heads (``jointspec.train.heads``): training measurably raises acceptance, the target's argmax is kept
in the data folder and reused, a run stopped by its time cap resumes, and the held-out split follows content.

Seeded and deterministic on one thread. The acceptance margin (trained above 0.3 and at least 0.25 above the untrained
head) was set from a run giving 0.44 vs 0.00.
"""

from __future__ import annotations

import torch

from jointspec.backends.hf import CausalLM
from jointspec.train.heads import HeadTrainConfig, HeadTrainer

from helpers import random_prompt, sps_acceptance, tiny_training_data, untrained_head


def test_training_raises_acceptance_well_above_the_untrained_head(target_model, trained_head_dir, tmp_path):
    untrained = tmp_path / "untrained"
    untrained_head(CausalLM(target_model)).save(untrained)
    rates = {name: sps_acceptance(target_model, folder)
             for name, folder in {"untrained": untrained, "trained": trained_head_dir}.items()}
    assert rates["trained"] > 0.3 and rates["trained"] > rates["untrained"] + 0.25, rates


def test_target_argmax_is_kept_in_the_data_folder_and_reused(target_model, tmp_path_factory, tmp_path, monkeypatch):
    """The first from-scratch run keeps the target's argmax in the data folder; later runs (warm starts too) read it
    instead of recomputing, and get the same labels, so they train the same draft."""
    from jointspec.train import heads as heads_module

    data = tiny_training_data(tmp_path_factory, target_model)
    target = CausalLM(target_model, name="tiny-target")
    config = HeadTrainConfig(draft_vocab_size=40, epochs=1, batch_tokens=512, warmup_steps=2, eval_every=5,
                             eval_fraction=0.1)
    first, _ = HeadTrainer(target, config).train(data, tmp_path / "a", progress=False)
    assert (data / heads_module.ARGMAX_FILE).is_file()
    calls = []
    real = heads_module._target_argmax

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(heads_module, "_target_argmax", counted)
    second, _ = HeadTrainer(target, config).train(data, tmp_path / "b", progress=False)
    assert calls == []  # nothing recomputed
    assert torch.equal(first.draft_vocab, second.draft_vocab)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    # A kept file that does not fit the folder is ignored and computed again.
    torch.save([torch.zeros(3, dtype=torch.int32)], data / heads_module.ARGMAX_FILE)
    HeadTrainer(target, config).train(data, tmp_path / "c", progress=False)
    assert calls and len(torch.load(data / heads_module.ARGMAX_FILE)) > 1


def test_a_run_stopped_by_its_time_cap_resumes_under_a_longer_one(target_model, tmp_path_factory, tmp_path,
                                                                   monkeypatch, capsys):
    """Stopping rules (--max-minutes, --patience) do not change what a step computes, so a run they stopped
    resumes from its checkpoint when given more room, and ends where an uncapped run ends: the same weights and the
    same evaluations. The cap's own evaluation, off the schedule, is not in the resumed bookkeeping (counted towards
    --patience, or kept as the best to beat, it made a resumed run stop or save elsewhere)."""
    from jointspec.train import heads as heads_module

    data = tiny_training_data(tmp_path_factory, target_model)
    target = CausalLM(target_model, name="tiny-target")
    settings = dict(draft_vocab_size=40, epochs=2, batch_tokens=512, warmup_steps=2, eval_every=3, eval_fraction=0.1)
    _, capped = HeadTrainer(target, HeadTrainConfig(**settings, max_minutes=0.0)).train(data, tmp_path / "a",
                                                                                        progress=False)
    assert [h.step for h in capped.history] == [1]  # the cap stops it after its first step
    assert "step 1: held-out agreement d1 " in capsys.readouterr().err  # shown without a progress bar too
    steps, step = [], heads_module._Run.step
    monkeypatch.setattr(heads_module._Run, "step", lambda run, group: steps.append(1) or step(run, group))
    HeadTrainer(target, HeadTrainConfig(**settings, max_minutes=0.0)).train(data, tmp_path / "a", progress=False)
    assert not steps  # the same cap again: no further step
    assert torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["state"]["step"] == 1
    resumed, result = HeadTrainer(target, HeadTrainConfig(**settings, patience=100)).train(data, tmp_path / "a",
                                                                                           progress=False)
    resumed_steps = len(steps)
    uncapped, full = HeadTrainer(target, HeadTrainConfig(**settings, patience=100)).train(data, tmp_path / "b",
                                                                                          progress=False)
    assert resumed_steps == len(steps) - resumed_steps - 1  # resumed after its first step, not restarted
    assert result.history == full.history and [h.step for h in full.history][-1] > 1
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), uncapped.state_dict().values()))


def test_a_cap_between_evaluations_does_not_save_a_head_the_schedule_would_not(target_model, tmp_path_factory,
                                                                                 tmp_path, monkeypatch):
    """The cap's own evaluation, off the schedule, used to save the head where it beat the scheduled best; a resumed
    run then ended with that head on disk (and a result naming another), where an uninterrupted run saves the
    scheduled one. Scripted scores (0.5 at step 3, 0.9 at the cap's step 4) and a clock of one second a step make it
    deterministic: no false failures."""
    import json
    from dataclasses import asdict

    from jointspec.train import heads as heads_module
    from jointspec.train.heads import EvalResult

    data = tiny_training_data(tmp_path_factory, target_model)
    target = CausalLM(target_model, name="tiny-target")
    clock = [0.0]
    monkeypatch.setattr(heads_module, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    step = heads_module._Run.step

    def timed_step(run, group):
        clock[0] += 1.0
        return step(run, group)

    def scripted(self, head, *args):
        return EvalResult(step=args[-1], agreement=[{3: 0.5, 4: 0.9}.get(args[-1], 0.1)], loss=1.0,
                          vocab_coverage=1.0)

    monkeypatch.setattr(heads_module._Run, "step", timed_step)
    monkeypatch.setattr(HeadTrainer, "evaluate", scripted)
    settings = dict(draft_vocab_size=40, epochs=2, batch_tokens=512, warmup_steps=2, eval_every=3, eval_fraction=0.1,
                    patience=100)
    saved_best = lambda folder: json.loads((folder / "draft.json").read_text())["training"]["best"]  # noqa: E731
    HeadTrainer(target, HeadTrainConfig(**settings, max_minutes=3.5 / 60)).train(data, tmp_path / "a", progress=False)
    assert saved_best(tmp_path / "a")["step"] == 3  # the scheduled best, not the cap's better one
    clock[0] = 0.0
    _, resumed = HeadTrainer(target, HeadTrainConfig(**settings)).train(data, tmp_path / "a", progress=False)
    clock[0] = 0.0
    _, full = HeadTrainer(target, HeadTrainConfig(**settings)).train(data, tmp_path / "b", progress=False)
    assert saved_best(tmp_path / "a") == saved_best(tmp_path / "b") == asdict(full.best) == asdict(resumed.best)


def test_a_checkpoint_made_on_other_data_is_not_resumed(target_model, tmp_path_factory, tmp_path, monkeypatch):
    """A checkpoint was matched on the settings and the draft vocabulary only, and a full vocabulary matches on any
    data: a second run on other data resumed the first's head and bookkeeping. It starts over now: every one of its
    steps runs in it (a resumed run would skip the checkpoint's one)."""
    from jointspec.train import heads as heads_module
    from jointspec.train.data import build_data

    target = CausalLM(target_model, name="tiny-target")
    first = tiny_training_data(tmp_path_factory, target_model)
    other = tmp_path / "other"
    build_data(target, None, [random_prompt(500 + i, length=8) for i in range(24)], other, max_new_tokens=24,
               max_length=64, shard_size=12, batch_size=8)
    settings = dict(draft_vocab_size=None, epochs=1, batch_tokens=256, warmup_steps=1, eval_every=2,
                    eval_fraction=0.2)
    HeadTrainer(target, HeadTrainConfig(**settings, max_minutes=0.0)).train(first, tmp_path / "a", progress=False)
    saved = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    assert saved["state"]["step"] == 1
    steps, step = [], heads_module._Run.step
    monkeypatch.setattr(heads_module._Run, "step", lambda run, group: steps.append(1) or step(run, group))
    HeadTrainer(target, HeadTrainConfig(**settings)).train(other, tmp_path / "a", progress=False)
    kept = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    assert kept["data_digest"] != saved["data_digest"]
    assert len(steps) == kept["state"]["step"] > 1


def test_the_held_out_split_follows_content_not_the_pool():
    # A sequence held out of one pool is held out of any larger pool with it (what keeps a warm start on a grown
    # pool from being evaluated on its own training data), and about the asked fraction is held out. The tokens are
    # fixed, so the hash-based split is deterministic: no false failures.
    from jointspec.train.heads import held_out_split

    pool = [torch.arange(i, i + 5 + i % 7) for i in range(400)]
    more = [torch.arange(1000 + i, 1006 + i) for i in range(300)]
    held, kept = held_out_split(pool, 0.1)
    assert sorted(held + kept) == list(range(400)) and 20 <= len(held) <= 60
    grown_held, _ = held_out_split(more[:150] + pool + more[150:], 0.1)
    assert {150 + i for i in held} == {i for i in grown_held if 150 <= i < 550}
    duplicate = held_out_split(pool + [pool[held[0]].clone()], 0.1)[0]
    assert 400 in duplicate  # the same text in another folder: held out as well
    tiny_held, tiny_kept = held_out_split(pool[:2], 0.0)
    assert len(tiny_held) == 1 and len(tiny_kept) == 1  # at least one of each
    assert held_out_split(pool[:2], 1.0)[1]
