import pytest
import torch

from compress.transforms.hadamard import hadamard, random_hadamard, random_orthogonal

# every order the rotations meet: tiny test widths and head sizes, SmolLM2 (576, head 64), common LLM widths
SIZES = (1, 2, 4, 12, 16, 20, 24, 36, 48, 64, 80, 96, 128, 576, 896, 960, 1536)


@pytest.mark.parametrize("n", SIZES)
def test_hadamard_is_a_plus_minus_one_matrix_with_orthogonal_rows(n):
    h = hadamard(n)
    assert h is not None and h.shape == (n, n)
    assert torch.equal(h.abs(), torch.ones(n, n, dtype=h.dtype))
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=h.dtype))  # exact in float64 integers


@pytest.mark.parametrize("n", (6, 7, 10, 576))
def test_random_rotations_are_orthogonal_and_seeded(n):
    q = random_hadamard(n, seed=3)
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=q.dtype), rtol=0, atol=1e-12)
    assert torch.equal(q, random_hadamard(n, seed=3))
    assert not torch.equal(q, random_hadamard(n, seed=4))


def test_orders_without_a_construction_fall_back_to_a_random_orthogonal_matrix():
    assert hadamard(6) is None and hadamard(7) is None  # no Hadamard of order 6 exists; 7 is odd
    torch.testing.assert_close(random_hadamard(6, 0), random_orthogonal(6, 0))
    q = random_hadamard(576, 0)  # a true Hadamard: every entry the same magnitude, outliers spread evenly
    torch.testing.assert_close(q.abs(), torch.full((576, 576), 576 ** -0.5, dtype=q.dtype))


def test_bad_order_is_refused():
    with pytest.raises(ValueError, match="order must be >= 1"):
        hadamard(0)
