"""`lmgeo.study_b.muon`: Muon's Newton–Schulz products on CPU are bf16 GEMMs computed in float32 and rounded
once; checked against an exact (float64) computation, against torch's own bf16 kernels, and step for step
against torch.optim.Muon."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _zeropower_via_newtonschulz

from lmgeo.study_b.muon import Muon, bf16_product, newton_schulz, same_shape_batches

BF16_ULP = 2.0**-7  # bf16 keeps 8 significant bits: one unit in the last place is ≤ 2⁻⁷ of the value


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def within_one_ulp(ours: torch.Tensor, expected: torch.Tensor) -> tuple[bool, float]:
    """Whether every entry is within one bf16 ulp of `expected`, and the share that is exactly equal."""
    ours, expected = ours.double(), expected.double()
    close = bool(((ours - expected).abs() <= BF16_ULP * expected.abs()).all())
    return close, float((ours == expected).double().mean())


@pytest.mark.parametrize("shape", [(16, 48, 300), (64, 64, 64), (7, 130, 9)])
def test_products_round_once_the_exact_result(shape) -> None:
    m, k, n = shape
    a, b, add = bf16(m, k, seed=0), bf16(k, n, seed=1), bf16(m, n, seed=2)
    # bf16 operands are exact in float64, and so is every product and (at these k) their sum
    exact = (DEFAULT_B * add.double() + DEFAULT_C * (a.double() @ b.double())).to(torch.bfloat16)
    close, equal = within_one_ulp(bf16_product(a, b, add=add, beta=DEFAULT_B, alpha=DEFAULT_C), exact)
    assert close and equal > 0.99
    close, equal = within_one_ulp(bf16_product(a, b), (a.double() @ b.double()).to(torch.bfloat16))
    assert close and equal > 0.99


def test_products_agree_with_torchs_bf16_kernel() -> None:
    a, b, add = bf16(32, 64, seed=3), bf16(64, 200, seed=4), bf16(32, 200, seed=5)
    close, equal = within_one_ulp(bf16_product(a, b, add=add, beta=DEFAULT_A), torch.addmm(add, a, b, beta=DEFAULT_A))
    assert close and equal > 0.99


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32), (300, 24)])
def test_newton_schulz_is_torchs_iteration(shape) -> None:
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(6))
    ours = newton_schulz(grad)
    theirs = _zeropower_via_newtonschulz(grad, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS)
    assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == grad.shape
    # Last-bit differences, carried through five iterations that do not converge (singular values end in
    # ~[0.7, 1.2]): up to ~1%. Two of torch's own bf16 kernels (oneDNN's AVX-512 BF16 GEMM and its reference
    # loop) differ by up to 0.33% on a 2048 × 64 matrix, and a coefficient 1% off or one step
    # fewer by 20-35%.
    assert float((ours.double() - theirs.double()).norm() / theirs.double().norm()) < 2e-2
    if shape[0] != shape[1]:  # a tall matrix is orthogonalised as its transpose: exactly the same numbers
        torch.testing.assert_close(newton_schulz(grad.T), ours.T, rtol=0, atol=0)


def _batched_step(optimizer: Muon) -> None:
    """CUDA's step (multi-tensor kernels, one Newton–Schulz chain per shape), here on CPU tensors."""
    group, params, grads, buffers = optimizer.param_groups[0], [], [], []
    optimizer._init_group(group, params, grads, buffers)
    with torch.no_grad():
        Muon._step_batched(group, params, grads, buffers)


@pytest.mark.parametrize("step", [Muon.step, _batched_step], ids=["per matrix (CPU)", "batched (CUDA)"])
def test_muon_steps_as_torch_muon(step) -> None:
    """Both of our steps against torch.optim.Muon: the same momentum, and updates within the Newton–Schulz
    tolerance above."""
    gen = torch.Generator().manual_seed(7)
    start = [torch.randn(shape, generator=gen) for shape in [(24, 8), (8, 24), (24, 8), (16, 16)]]
    ours = [torch.nn.Parameter(w.clone()) for w in start]
    theirs = [torch.nn.Parameter(w.clone()) for w in start]
    settings = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
    mine, torchs = Muon(ours, **settings), torch.optim.Muon(theirs, **settings)
    for _ in range(4):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        step(mine)
        torchs.step()
    for p, q, w in zip(ours, theirs, start, strict=True):
        torch.testing.assert_close(mine.state[p]["momentum_buffer"], torchs.state[q]["momentum_buffer"], rtol=0, atol=0)
        moved = float((q.detach() - w).norm())
        assert float((p.detach() - q.detach()).norm()) < 2e-2 * moved


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_a_stack_is_orthogonalised_matrix_by_matrix(shape) -> None:
    """The batched chain (CUDA's) of a stack gives each matrix its own iteration: against each matrix
    alone, within the last-bit differences of two bf16 GEMM kernels (see above), and products of a stack
    round once like the 2-D ones."""
    gen = torch.Generator().manual_seed(8)
    stack = torch.randn(3, *shape, generator=gen)
    together = newton_schulz(stack)
    assert together.shape == stack.shape and together.dtype == torch.bfloat16
    for i in range(3):
        alone = newton_schulz(stack[i])
        assert float((together[i].double() - alone.double()).norm() / alone.double().norm()) < 2e-2
    a, b, add = bf16(3, 16, 48, seed=9), bf16(3, 48, 20, seed=10), bf16(3, 16, 20, seed=11)
    exact = (DEFAULT_B * add.double() + DEFAULT_C * (a.double() @ b.double())).to(torch.bfloat16)
    close, equal = within_one_ulp(bf16_product(a, b, add=add, beta=DEFAULT_B, alpha=DEFAULT_C), exact)
    assert close and equal > 0.99


def test_equal_shapes_are_batched_together_in_order_of_appearance() -> None:
    params = [torch.empty(s) for s in [(4, 8), (8, 4), (4, 8), (3, 3), (8, 4)]]
    assert same_shape_batches(params) == [[0, 2], [1, 4], [3]]
