"""The grid search AWQ's scale exponent uses (compress/methods/common/grid.py): coarse to fine finds the full grid's
minimum on a unimodal loss in fewer visits."""
import pytest

from compress.methods.common.grid import grid_order


@pytest.mark.parametrize("grid,coarse", [(20, 4), (20, 5), (10, 3), (7, 2)])
def test_coarse_to_fine_finds_the_grids_minimum_on_a_unimodal_loss_in_fewer_visits(grid, coarse):
    for best in range(grid):
        visits = []

        def loss(k, best=best):
            visits.append(k)
            return (k - best) ** 2 + 0.1 * k  # unimodal, ties broken toward the smaller k
        want = min(range(grid), key=lambda k: ((k - best) ** 2 + 0.1 * k, k))
        assert grid_order(grid, coarse)(loss) == want
        assert len(visits) == len(set(visits)) < grid


def test_every_point_is_the_full_grid_and_ties_go_to_the_smaller_ratio():
    visits = []
    assert grid_order(6)(lambda k: visits.append(k) or abs(k - 2.5)) == 2
    assert visits == list(range(6))
