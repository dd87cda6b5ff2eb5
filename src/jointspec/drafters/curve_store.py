"""Measured cost curves kept across processes, for a command that would otherwise measure one at every start.

:func:`~jointspec.drafters.costaware.measure_cost_curve` times a few dozen target forwards, once per process: a
server or a benchmark pays that once, but ``jointspec generate`` paid it before every answer, and on a larger model
that was seconds of a short run. Inside :func:`persisted_curves` a curve measured for a model that carries a load
identity (``jointspec_identity``: its file's path, size and modification time, and the load's options; set by
``load_model``) is written to the cache folder, and the next process with the same identity, settings, CPU and
kernel build reads it instead of measuring.

A curve only decides how long drafts are (speed), never which tokens are committed, so a stale entry costs speed at
most. Entries expire after :data:`MAX_AGE_DAYS`; ``JOINTSPEC_COST_CURVES=off`` measures every time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

MAX_AGE_DAYS = 7
ENV = "JOINTSPEC_COST_CURVES"

_directory: Path | None = None  # set inside persisted_curves()


def default_directory() -> Path:
    from jointspec.backends.embedded import cache_root

    return cache_root() / "cost-curves"


@contextlib.contextmanager
def persisted_curves(directory: Path | None = None) -> Iterator[None]:
    """Within the block, curves of models with a load identity are read from and written to ``directory``
    (default: :func:`default_directory`), unless ``JOINTSPEC_COST_CURVES=off``."""
    global _directory
    previous = _directory
    if os.environ.get(ENV, "").strip().lower() not in ("off", "0", "no", "false"):
        _directory = Path(directory) if directory is not None else default_directory()
    try:
        yield
    finally:
        _directory = previous


def entry_path(identity: str | None, settings: tuple) -> Path | None:
    """Where the curve of ``identity`` measured with ``settings`` is kept (None: not kept, outside
    :func:`persisted_curves` or for a model without an identity)."""
    if _directory is None or not identity:
        return None
    import jointspec
    from jointspec.kernels.cpu import cpu_signature
    from jointspec.kernels.grouped import source_digest

    key = json.dumps([identity, [str(part) for part in settings], cpu_signature(), source_digest(),
                      jointspec.__version__])
    return _directory / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def read(path: Path | None) -> dict[int, float] | None:
    """The costs kept at ``path`` (None if absent, expired or unreadable)."""
    if path is None:
        return None
    try:
        if time.time() - path.stat().st_mtime > MAX_AGE_DAYS * 86400:
            return None
        costs = {int(n): float(c) for n, c in json.loads(path.read_text())["target_cost"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if len(costs) < 2 or 1 not in costs or not all(math.isfinite(c) and c > 0 for c in costs.values()):
        return None
    return costs


def write(path: Path | None, costs: Mapping[int, float]) -> None:
    """Keep ``costs`` at ``path`` (written whole or not at all; a read-only cache is skipped)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"target_cost": {str(n): c for n, c in costs.items()}}))
        partial.replace(path)
    except OSError:
        pass
