"""Muon, exactly as `torch.optim.Muon` steps, with its Newton–Schulz products run where they are fast.

torch.optim.Muon orthogonalises in bfloat16: each product of its quintic Newton–Schulz iteration is a bf16
GEMM (bf16 operands, float32 accumulation, the result rounded once to bf16). On CPU, under the AVX2 pin that
makes results the same on every x86-64 machine (`lmgeo.core.determinism`), oneDNN has no bf16 GEMM and
falls back to a reference loop: a (64 × 64)·(64 × 2048) product takes 16 ms against 0.18 ms for the same
product in float32 (measured on this project's 2-core AMD EPYC), and the iteration took two thirds of a
`muon_head` run. So on CPU each product is computed in float32 from the same bf16 operands and rounded once
to bf16: the rounding points of a bf16 GEMM, only the float32 summation order may differ (a last-bit change
of some entries, as between any two bf16 GEMM kernels). On CUDA it is torch's own bf16 GEMM.

On CUDA the matrices of a parameter group that share a shape are orthogonalised together: one batched
GEMM chain (`bmm`/`baddbmm`) per shape instead of one chain per matrix (GPT-2 small's 48 hidden matrices
are 4 shapes; one at a time the step was launch-bound), and the momentum, decay and update are applied with
torch's multi-tensor (`_foreach_`) kernels. Batching changes no rounding point (each matrix is its own GEMM
of the batch). On CPU every matrix is still stepped alone, exactly as before: a batched float32 GEMM may sum
in another order than the per-matrix one, and the CPU path is bit for bit the one the study's results come
from (tests/test_pinned_training.py).

Everything else (momentum, Nesterov read, shape scale, decoupled weight decay, the defaults) is torch's: the
class reuses torch.optim.Muon's constructor, state and private helpers, pinned with torch in constraints.txt.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr


def bf16_product(a: Tensor, b: Tensor, add: Tensor | None = None, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """`beta·add + alpha·(a @ b)` of bf16 matrices, or of equal-shape stacks of them (3-D), as a bf16 GEMM
    computes it: accumulated in float32, rounded once to bf16."""
    on_cpu = a.device.type == "cpu"
    a, b = (a.float(), b.float()) if on_cpu else (a, b)
    if add is None:
        product = a @ b
    elif a.ndim == 2:
        product = torch.addmm(add.float() if on_cpu else add, a, b, beta=beta, alpha=alpha)
    else:
        product = torch.baddbmm(add.float() if on_cpu else add, a, b, beta=beta, alpha=alpha)
    return product.bfloat16() if on_cpu else product


def newton_schulz(
    grad: Tensor,
    coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
    steps: int = DEFAULT_NS_STEPS,
    eps: float = EPS,
) -> Tensor:
    """torch.optim.Muon's quintic Newton–Schulz orthogonalisation (its `_zeropower_via_newtonschulz`, step
    for step), in bf16, with `bf16_product` for its products: of a 2-D `grad`, or of each matrix of a stack
    `(batch, rows, cols)` of equal-shape matrices at once."""
    a, b, c = coefficients
    ortho = grad.bfloat16()
    tall = grad.size(-2) > grad.size(-1)
    if tall:
        ortho = ortho.mT
    # spectral norm ≤ Frobenius norm = 1 (one norm for a matrix, as torch takes it; one per matrix of a stack)
    ortho.div_((ortho.norm() if ortho.ndim == 2 else ortho.norm(dim=(-2, -1), keepdim=True)).clamp(min=eps))
    for _ in range(steps):
        gram = bf16_product(ortho, ortho.mT)
        update = bf16_product(gram, gram, add=gram, beta=b, alpha=c)
        ortho = bf16_product(update, ortho, add=ortho, beta=a)
    return ortho.mT if tall else ortho


def same_shape_batches(params: list[Tensor]) -> list[list[int]]:
    """Indices of `params` grouped by shape, in order of first appearance: the matrices orthogonalised
    together."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(params):
        by_shape.setdefault(tuple(p.shape), []).append(i)
    return list(by_shape.values())


class Muon(torch.optim.Muon):
    """torch.optim.Muon (same arguments, state and step) with `newton_schulz` as its orthogonalisation,
    batched over a group's equal-shape matrices on CUDA."""

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
            if not params:
                continue
            if params[0].is_cuda:
                self._step_batched(group, params, grads, buffers)
            else:
                self._step_each(group, params, grads, buffers)
        return loss

    @staticmethod
    def _step_each(group: dict, params: list[Tensor], grads: list[Tensor], buffers: list[Tensor]) -> None:
        """The CPU step: each matrix alone, as torch.optim.Muon takes it."""
        lr, momentum = group["lr"], group["momentum"]
        for param, grad, buffer in zip(params, grads, buffers, strict=True):
            buffer.lerp_(grad, 1 - momentum)
            update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))

    @staticmethod
    def _step_batched(group: dict, params: list[Tensor], grads: list[Tensor], buffers: list[Tensor]) -> None:
        """The CUDA step: the same arithmetic, multi-tensor kernels for the elementwise parts and one
        Newton–Schulz chain per shape."""
        lr, momentum = group["lr"], group["momentum"]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        for batch in same_shape_batches(params):
            stack = torch.stack([updates[i] for i in batch])
            ortho = newton_schulz(stack, group["ns_coefficients"], group["ns_steps"], group["eps"])
            scale = _adjust_lr(lr, group["adjust_lr_fn"], params[batch[0]].shape)
            # bf16 → the parameters' dtype is exact; one dtype keeps `_foreach_add_` on its fused kernel
            torch._foreach_add_(
                [params[i] for i in batch], list(ortho.to(params[batch[0]].dtype).unbind(0)), alpha=-scale
            )
