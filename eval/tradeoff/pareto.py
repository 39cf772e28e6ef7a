"""The Pareto frontier of report rows and the recommendations read off it. Pure functions on plain numbers:
every objective is minimized (pass -speed for a speed)."""
from __future__ import annotations

from dataclasses import dataclass


def dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """a is at least as good as b on every objective and better on one (all minimized)."""
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


def frontier(points: dict[str, tuple[float, ...]]) -> list[str]:
    """Labels of the points no other point dominates, ordered by their first objective."""
    keep = [k for k, p in points.items() if not any(dominates(q, p) for j, q in points.items() if j != k)]
    return sorted(keep, key=lambda k: points[k])


@dataclass(frozen=True)
class Candidate:
    label: str
    size_bytes: float
    ppl: float
    decode_tok_s: float | None = None


@dataclass(frozen=True)
class Recommendation:
    goal: str  # what was asked
    label: str | None  # the variant that answers it, None when none qualifies
    why: str  # one line with the numbers


def _pct(value: float, base: float) -> str:
    return f"{100 * (value / base - 1):+.1f}%"


def recommend(rows: list[Candidate], baseline: Candidate, max_ppl_increase: float,
              max_size: float) -> list[Recommendation]:
    """Smallest and fastest variant within ``max_ppl_increase`` percent of the baseline's perplexity, and the
    most accurate one of at most ``max_size`` bytes."""
    limit = baseline.ppl * (1 + max_ppl_increase / 100)
    within = [r for r in rows if r.ppl <= limit]
    out = []
    goal = f"smallest within {max_ppl_increase:g}% of {baseline.label}'s perplexity"
    best = min(within, key=lambda r: (r.size_bytes, r.ppl), default=None)
    out.append(Recommendation(goal, best and best.label, "none qualifies" if best is None else
                              f"{best.size_bytes / 2**20:.1f} MiB, ppl {best.ppl:.2f} ({_pct(best.ppl, baseline.ppl)})"))
    timed = [r for r in within if r.decode_tok_s]
    goal = f"fastest decode within {max_ppl_increase:g}% of {baseline.label}'s perplexity"
    best = max(timed, key=lambda r: (r.decode_tok_s, -r.ppl), default=None)
    out.append(Recommendation(goal, best and best.label, "none qualifies" if best is None else
                              f"{best.decode_tok_s:.1f} tok/s at batch 1, ppl {best.ppl:.2f} "
                              f"({_pct(best.ppl, baseline.ppl)})"))
    fits = [r for r in rows if r.size_bytes <= max_size]
    goal = f"most accurate at most {max_size / 2**20:.1f} MiB"
    best = min(fits, key=lambda r: (r.ppl, r.size_bytes), default=None)
    out.append(Recommendation(goal, best and best.label, "none fits" if best is None else
                              f"ppl {best.ppl:.2f} ({_pct(best.ppl, baseline.ppl)}), {best.size_bytes / 2**20:.1f} MiB"))
    return out
