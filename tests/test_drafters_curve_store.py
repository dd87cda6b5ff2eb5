"""Cost curves kept across processes (drafters/curve_store.py): inside ``persisted_curves`` a curve measured for a
model with a load identity is read back by the next process with the same identity and settings, and measured again
for any other, after expiry, from an unreadable entry, or with the store off; ``load_model`` gives local models an
identity that changes with their files."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from jointspec.backends.loading import load_model, quantized_copy, source_identity, stock_copy
from jointspec.core.target import TargetCapabilities
from jointspec.drafters import curve_store
from jointspec.drafters.costaware import measure_cost_curve
from jointspec.drafters.curve_store import persisted_curves

from helpers import tiny_tokenizer

SIZES = (1, 2, 4)


class Adapter:
    """The target interface, counting its forwards; a new one per 'process' (the in-process memo is per object)."""

    vocab_size = 50
    max_context = 64
    device = torch.device("cpu")
    capabilities = TargetCapabilities()

    def __init__(self, identity: str | None = "model.gguf:1:2|int4") -> None:
        self.num_cached = 0
        self.forwards = 0
        if identity is not None:
            self.jointspec_identity = identity

    def forward(self, token_ids, num_logits=None):
        self.forwards += 1
        self.num_cached += len(token_ids)

    def crop(self, length: int) -> None:
        self.num_cached = length


def measure(adapter):
    return measure_cost_curve(adapter, sizes=SIZES, repeats=2, context_tokens=8)


def test_a_kept_curve_is_read_back_by_the_next_process_and_only_by_its_twin(tmp_path, monkeypatch):
    monkeypatch.delenv(curve_store.ENV, raising=False)
    with persisted_curves(tmp_path):
        first = Adapter()
        curve = measure(first)
        assert first.forwards > 0 and len(list(tmp_path.glob("*.json"))) == 1
        again = Adapter()
        assert measure(again).target_cost == curve.target_cost and again.forwards == 0
        other = Adapter("model.gguf:1:3|int4")  # the file changed
        measure(other)
        assert other.forwards > 0 and len(list(tmp_path.glob("*.json"))) == 2
        torch.set_num_threads(2)
        try:
            threads = Adapter()
            measure(threads)
            assert threads.forwards > 0
        finally:
            torch.set_num_threads(1)  # conftest's setting
        longer = Adapter()
        measure_cost_curve(longer, sizes=SIZES, repeats=2, context_tokens=16)  # another measurement's settings
        assert longer.forwards > 0
    outside = Adapter()
    measure(outside)
    assert outside.forwards > 0  # outside the block nothing is read


def test_nothing_is_kept_without_an_identity_outside_the_block_or_with_the_store_off(tmp_path, monkeypatch):
    monkeypatch.setenv("JOINTSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(curve_store.ENV, raising=False)
    measure(Adapter())
    with persisted_curves(tmp_path / "kept"):
        measure(Adapter(identity=None))
    monkeypatch.setenv(curve_store.ENV, "off")
    with persisted_curves(tmp_path / "off"):
        measure(Adapter())
    assert not list(tmp_path.rglob("*.json"))


def test_expired_and_unreadable_entries_are_measured_again_and_replaced(tmp_path, monkeypatch):
    monkeypatch.delenv(curve_store.ENV, raising=False)
    with persisted_curves(tmp_path):
        measure(Adapter())
        (entry,) = tmp_path.glob("*.json")
        old = time.time() - (curve_store.MAX_AGE_DAYS + 1) * 86400
        os.utime(entry, (old, old))
        expired = Adapter()
        measure(expired)
        assert expired.forwards > 0 and time.time() - entry.stat().st_mtime < 3600
        for broken in ("{not json", json.dumps({"target_cost": {"1": -1.0, "2": 1.0, "4": 2.0}}),
                       json.dumps({"target_cost": {"2": 1.0, "4": 2.0}})):
            entry.write_text(broken)
            adapter = Adapter()
            measure(adapter)
            assert adapter.forwards > 0, broken
            assert curve_store.read(entry) is not None  # rewritten whole


def test_local_models_have_an_identity_that_follows_their_files(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"12345")
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    before = source_identity(str(folder)), source_identity(str(gguf_file))
    assert all(before) and before[0] != before[1]
    (folder / "model.safetensors").write_bytes(b"123456")
    gguf_file.write_bytes(b"GGUF2")
    after = source_identity(str(folder)), source_identity(str(gguf_file))
    assert after[0] != before[0] and after[1] != before[1]
    assert source_identity("some-org/some-model") is None  # a hub id: measured every time


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_load_model_marks_a_local_model_with_its_identity_and_options(tmp_path, target_model, quantize):
    folder = tmp_path / "tiny"
    target_model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    target, _ = load_model(str(folder), quantize=quantize)
    identity = target.model.jointspec_identity
    assert identity.startswith(source_identity(str(folder))) and f"|{quantize}|" in identity
    if quantize == "none":  # a copy on other kernels is not the loaded model
        assert not hasattr(quantized_copy(target, "int8").model, "jointspec_identity")
        assert not hasattr(stock_copy(target).model, "jointspec_identity")
        assert target.model.jointspec_identity == identity
