"""Muon, exactly as `torch.optim.Muon` steps, with its Newton–Schulz products run where they are fast.

torch.optim.Muon orthogonalises in bfloat16: each product of its quintic Newton–Schulz iteration is a bf16
GEMM (bf16 operands, float32 accumulation, the result rounded once to bf16). On CPU, under the AVX2 pin that
makes results the same on every x86-64 machine (`pipeline.core.determinism`), oneDNN has no bf16 GEMM and
falls back to a reference loop: a (64 × 64)·(64 × 2048) product takes 16 ms against 0.18 ms for the same
product in float32 (measured on this project's 2-core AMD EPYC), and the iteration took two thirds of a
`muon_head` run. So on CPU each product is computed in float32 from the same bf16 operands and rounded once
to bf16: the rounding points of a bf16 GEMM, only the float32 summation order may differ (a last-bit change
of some entries, as between any two bf16 GEMM kernels). On CUDA it is torch's own bf16 GEMM.

Everything else (momentum, Nesterov read, shape scale, decoupled weight decay, the defaults) is torch's: the
class reuses torch.optim.Muon's constructor, state and private helpers, pinned with torch in constraints.txt.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr


def bf16_product(a: Tensor, b: Tensor, add: Tensor | None = None, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """`beta·add + alpha·(a @ b)` of bf16 matrices as a bf16 GEMM computes it: accumulated in float32, rounded
    once to bf16."""
    if a.device.type != "cpu":
        return a @ b if add is None else torch.addmm(add, a, b, beta=beta, alpha=alpha)
    if add is None:
        return (a.float() @ b.float()).bfloat16()
    return torch.addmm(add.float(), a.float(), b.float(), beta=beta, alpha=alpha).bfloat16()


def newton_schulz(
    grad: Tensor,
    coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
    steps: int = DEFAULT_NS_STEPS,
    eps: float = EPS,
) -> Tensor:
    """torch.optim.Muon's quintic Newton–Schulz orthogonalisation of a 2-D `grad` (its
    `_zeropower_via_newtonschulz`, step for step), in bf16, with `bf16_product` for its products."""
    a, b, c = coefficients
    ortho = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm ≤ Frobenius norm = 1
    for _ in range(steps):
        gram = bf16_product(ortho, ortho.T)
        update = bf16_product(gram, gram, add=gram, beta=b, alpha=c)
        ortho = bf16_product(update, ortho, add=ortho, beta=a)
    return ortho.T if tall else ortho


class Muon(torch.optim.Muon):
    """torch.optim.Muon (same arguments, state and step) with `newton_schulz` as its orthogonalisation."""

    @torch.no_grad()
    def step(self, closure=None):  # torch.optim.Optimizer.step's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            buffers: list[Tensor] = []
            self._init_group(group, params, grads, buffers)
            lr, momentum = group["lr"], group["momentum"]
            for param, grad, buffer in zip(params, grads, buffers, strict=True):
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss
