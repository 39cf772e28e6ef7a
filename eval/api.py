"""The Python API's evaluate (``compress.evaluate``, ``compress.api.evaluate``), here beside what it runs: the
quantizer's package imports nothing from eval/ (tests/test_imports.py)."""
from __future__ import annotations

from collections.abc import Iterable

from eval.result import EvalResult


def evaluate(model: str | None, baseline: str | None = None, ppl: Iterable[str] = ("wiki",), tasks: Iterable[str] = (),
             limit: int | None = None, seqlen: int = 512, max_windows: int | None = None, batch_size: int = 8,
             progress=None, server=None) -> EvalResult:
    """``compress.api.evaluate``'s body (its docstring says what it returns): the report's arguments under the API's
    names, a server URL made a ServerTarget."""
    from eval.report import evaluate as run

    if isinstance(server, str):
        from eval.served import ServerTarget

        server = ServerTarget(server)
    kw = {} if progress is None else {"progress": progress}
    return run(model, baseline_spec=baseline, ppl_sources=list(ppl), tasks=list(tasks), limit=limit, seqlen=seqlen,
               max_windows=max_windows, batch_size=batch_size, server=server, **kw)
