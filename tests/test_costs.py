"""Closed-form sizes and counts quoted by chapter 1."""

from flashlab import costs


def test_one_8192_matrix_in_two_bytes_is_128_mib():
    assert costs.matrix_bytes(8192, 8192, 2) == 128 * costs.MIB


def test_seed_001_transfer_totals():
    assert costs.dense_transfers(6, 2, block_q=2) == 240
    assert costs.fused_transfers(6, 2, block_q=2) == 96


def test_flops_count_both_matmuls():
    assert costs.flops(3, 5, 4, 2) == 2 * 3 * 5 * 4 + 2 * 3 * 5 * 2


def test_backward_flops_count_the_five_products():
    nq, nk, d, dv = 3, 5, 4, 2
    products = (nq * nk * d  # S = Q K^T, recomputed
                + nq * nk * dv  # dP = dO V^T
                + nk * nq * dv  # dV = P^T dO
                + nq * nk * d  # dQ = dS K
                + nk * nq * d)  # dK = dS^T Q
    assert costs.flops(nq, nk, d, dv, backward=True) == 2 * products
    assert costs.flops(8, 8, 4, backward=True, causal=True) == 5 * 8 * 8 * 4
