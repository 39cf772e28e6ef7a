"""Per-variant, per-stage results on disk: a stage's file is named by the hash of everything it depends
on, written atomically, so a second run reuses it and a killed run resumes after the last finished stage."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path


def digest(obj) -> str:
    """A short, stable hash of any JSON-able description."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def fingerprint(path: str | Path) -> list:
    """What identifies a file or a folder's top-level files without reading them: names, sizes, mtimes."""
    p = Path(path).resolve()
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
    return [str(p)] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place."""
    from compress.exporters.dispatch import atomic_file

    with atomic_file(path, overwrite=True) as tmp:
        tmp.write_text(text)


def write_atomic_bytes(path: Path, data: bytes) -> None:
    from compress.exporters.dispatch import atomic_file

    with atomic_file(path, overwrite=True) as tmp:
        tmp.write_bytes(data)


class StageCache:
    """``root/cache/<variant>/<stage>-<key>.json``: one file per finished stage of one variant."""

    def __init__(self, root: Path):
        self.root = Path(root) / "cache"
        self.hits: list[str] = []  # "<variant>/<stage>" reused this run (what a test or a log can check)

    def path(self, variant: str, stage: str, key: str) -> Path:
        return self.root / variant / f"{stage}-{key}.json"

    def run(self, variant: str, stage: str, key: str, compute: Callable[[], dict]) -> dict:
        """The stored result of this stage, or ``compute()`` stored now; a raising ``compute`` stores nothing."""
        path = self.path(variant, stage, key)
        if path.is_file():
            self.hits.append(f"{variant}/{stage}")
            return json.loads(path.read_text())
        result = compute()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(result, indent=1, default=float))
        return result
