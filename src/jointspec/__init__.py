"""jointspec: speculative and multi-token joint decoding for Hugging Face causal LMs.

Importing the package loads nothing else (no torch, no submodule): import what you use, e.g.
``from jointspec.api import Pipeline``.
"""

from __future__ import annotations


def _version() -> str:
    """The installed distribution's version; from pyproject.toml beside the source when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("jointspec")
    except metadata.PackageNotFoundError:
        import re
        from pathlib import Path

        try:
            text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
        except OSError:
            return "unknown"
        found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
        return found.group(1) if found else "unknown"


__version__ = _version()
