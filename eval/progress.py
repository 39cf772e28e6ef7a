"""Progress for the long evaluation steps: library code reports ``(what, done, total, unit)``, the command
line draws it as tqdm bars on stderr, and third-party bars (lm-eval, transformers' GGUF conversion,
datasets) are kept quiet while ours run."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# (what is running, e.g. "awq4: ppl wiki", items done, items in all, unit of an item)
StepProgress = Callable[[str, int, int, str], None]
# modules whose module-level ``tqdm`` draws a bar per call: transformers' GGUF loader (one per load);
# eval/tasks.py adds lm-eval's "Building contexts" bar (one per task)
GGUF_BARS = ("transformers.modeling_gguf_pytorch_utils",)


def no_progress(what: str, done: int, total: int, unit: str = "it") -> None:
    """The default StepProgress: report nothing."""


class Bars:
    """A StepProgress drawing one tqdm bar on stderr per stage, with its rate and time left."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self._bar = None
        self._what = None

    def __call__(self, what: str, done: int, total: int, unit: str = "it") -> None:
        if self._bar is None or what != self._what:
            from tqdm import tqdm

            self.close()
            self._what = what
            self._bar = tqdm(total=total, desc=what, unit=unit, file=sys.stderr, disable=self.quiet,
                             dynamic_ncols=True, mininterval=1.0)
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def note(self, line: str) -> None:
        """A line above the bars (a stage that has no item count), unless quiet."""
        if not self.quiet:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar = self._what = None


def _disabled_tqdm(original):
    def quiet(*args, **kwargs):
        kwargs["disable"] = True
        return original(*args, **kwargs)
    return quiet


@contextmanager
def quiet_third_party(modules: tuple[str, ...] = GGUF_BARS) -> Iterator[None]:
    """Inside: datasets' and transformers' bars off, and each of ``modules``' ``tqdm`` made silent
    (they draw one bar per task or per load, which would interleave with ours); restored on exit."""
    import datasets
    from transformers.utils import logging as hf_logging

    datasets_was_on = datasets.is_progress_bar_enabled()
    hf_was_on = hf_logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    swapped = []
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "tqdm"):
            swapped.append((mod, mod.tqdm))
            mod.tqdm = _disabled_tqdm(mod.tqdm)
    try:
        yield
    finally:
        for mod, original in swapped:
            mod.tqdm = original
        if datasets_was_on:
            datasets.enable_progress_bars()
        if hf_was_on:
            hf_logging.enable_progress_bar()
