"""Failures a user can act on: a bad input is one line naming the fix; a fault deep inside a step, on a model
nobody here tried, is one line naming the step, the model type and the cause, with the traceback behind ``-v``.

Library code raises ``ValueError`` (and the other :data:`USER_ERRORS`) for bad input. Anything else that
escapes a step is a fault: :func:`during` tags it with where it happened (Python's exception notes), and the
CLI turns it into :func:`fault_line`.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

# ConnectionError: a server that `compress eval --server` cannot reach (a wrong URL, or none running)
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, MemoryError, ConnectionError)
REPORT_HINT = ("run again with -v (`compress -v ...`) for the traceback; if the model loads in transformers, "
               "please report it with that traceback and the model's config.json")


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(text)
    else:  # Python 3.10: the attribute 3.11's add_note fills
        exc.__notes__ = [*getattr(exc, "__notes__", []), text]


@contextlib.contextmanager
def during(what: str):
    """Tag a fault raised inside the block with ``what`` was being done ("block 3 of 24", "calibration")."""
    try:
        yield
    except USER_ERRORS:
        raise
    except Exception as e:
        _note(e, f"while {what}")
        raise


def model_type(spec: str | None) -> str:
    """The model type of an HF folder or a GGUF file by its own metadata, read cheaply; never raises."""
    if not spec:
        return "unknown"
    try:
        path = Path(spec).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            return str(json.loads((path / "config.json").read_text()).get("model_type") or "unknown")
        gguf = path if path.suffix == ".gguf" else next(iter(sorted(path.glob("*.gguf"))), None) if path.is_dir() \
            else None
        if gguf is None:
            from compress.format.models import resolve  # an embedded name

            src = resolve(spec)
            gguf = src.path / src.gguf_file if src.gguf_file else None
            if gguf is None:
                return model_type(str(src.path))
        from gguf import GGUFReader

        field = GGUFReader(gguf).get_field("general.architecture")
        return bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"
    except Exception:  # a description for an error line must not raise an error of its own
        return "unknown"


def fault_line(command: str, spec: str | None, exc: BaseException) -> str:
    """One line: the step, the model and its type, where inside the step, and the cause."""
    where = "".join(f" {n}" for n in getattr(exc, "__notes__", ()) if n.startswith("while "))
    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else "(no message)"
    model = f" on {spec} (model type {model_type(spec)})" if spec else ""
    return f"error: {command} failed{model}{where}: {type(exc).__name__}: {cause}"
