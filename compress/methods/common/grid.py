"""A search over a 1-D grid of candidates ``0..grid-1`` that visits every point, or coarse to fine: AWQ's scale
exponent, where each visit costs a forward of the judged module over thousands of tokens."""
from __future__ import annotations

from collections.abc import Callable


def grid_order(grid: int, coarse: int = 0) -> Callable[[Callable[[int], float]], int]:
    """How a search visits the grid points ``0..grid-1``: every one (``coarse`` 0), or every ``coarse``-th, then the
    neighbours of the best so far at half the step (rounded up), down to 1 (20 points: 5 + 2 + 2 = 9 visits). On a loss that is
    unimodal over the grid both find the same point. Returns ``search(loss_of_point) -> best point``."""
    def search(loss: Callable[[int], float]) -> int:
        seen: dict[int, float] = {}

        def visit(k: int) -> None:
            if 0 <= k < grid and k not in seen:
                seen[k] = loss(k)
        if not coarse:
            for k in range(grid):
                visit(k)
            return min(seen, key=lambda k: (seen[k], k))
        for k in range(0, grid, coarse):
            visit(k)
        step = coarse
        while step > 1:
            step = (step + 1) // 2  # the minimum lies within (best - step, best + step)
            best = min(seen, key=lambda k: (seen[k], k))
            visit(best - step)
            visit(best + step)
        return min(seen, key=lambda k: (seen[k], k))
    return search
