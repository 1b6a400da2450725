"""Train one small LM with one head-optimizer recipe, recording the head step's Hilbert geometry.

Readable top to bottom, nanoGPT style: data windows, model, optimizer, loop. Each step records
SPEC §3.3's columns; every `geometry_interval` steps it also measures the realised head update ΔW
(the head step alone): on a fixed probe batch (and checks `hilbert_realized ≤ hilbert_bound`), on the
training batch it was computed from, and against that batch's head gradient. The test split is read
once, after the last step.

On CUDA a step runs under bf16 autocast with the fused loss (`lmgeo.study_b.loss`) and never waits for
the device: its loss is copied back asynchronously and read when it has arrived (`LossReadback`), and the
optimizers keep their data-dependent scalars on the device (`lmgeo.study_b.optim.host_scalar`). So a
divergence is noticed a few steps late there (at most `MAX_UNREAD_LOSSES`, and always before a geometry
step): it is recorded at the step whose loss was first non-finite, and the `final` checkpoint of a diverged
CUDA run holds the weights of the step at which it was noticed. On the CPU every loss is read at once,
before its backward, as it always was.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from lmgeo.core.contracts import STEPS, RunRecord, RunSpec
from lmgeo.models.registry import build_model, head_of
from lmgeo.study_b import hilbert
from lmgeo.study_b.config import TrainConfig
from lmgeo.study_b.hilbert import center_rows
from lmgeo.study_b.loss import use_fused_loss
from lmgeo.study_b.optim import Scalar, build_optimizers, host_scalar

# Relative slack for the invariant: both sides are float32 reductions of the same ΔW.
INVARIANT_RTOL = 1e-4
# On CUDA, the most training losses still in flight to the host before the loop waits for the oldest: the
# longest a divergence can go unnoticed, in steps.
MAX_UNREAD_LOSSES = 8


class InvariantViolated(AssertionError):
    """hilbert_realized exceeded hilbert_bound with an exact diameter: a bug, never a data issue."""


class NumericBlowUp(ArithmeticError):
    """A head step whose update or geometry is not finite: the run has diverged (a step size too large for
    float32), which the run records; the invariant speaks of finite numbers only."""


def pick_device(preference: str) -> torch.device:
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(preference)


class Windows:
    """Random (seeded) or fixed windows of `seq_len` tokens from a token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int, device: torch.device):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"token stream of {len(tokens)} is shorter than one window of {seq_len + 1}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.device = seq_len, device

    def random(self, batch: int, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (batch,), generator=gen)
        return self._gather(starts)

    def fixed(self, count: int) -> torch.Tensor:
        """Evenly spaced windows: the same val/probe batches for every run."""
        starts = torch.linspace(0, len(self.tokens) - self.seq_len - 1, count).long()
        return self._gather(starts)

    def _gather(self, starts: torch.Tensor) -> torch.Tensor:
        idx = starts[:, None] + torch.arange(self.seq_len)[None, :]
        return self.tokens[idx].to(self.device)


class HeadInputs:
    """Captures the head's input (the final hidden states) with a forward pre-hook."""

    def __init__(self, head: torch.nn.Module):
        self.last: torch.Tensor | None = None
        self._handle = head.register_forward_pre_hook(self._capture)

    def _capture(self, _module: torch.nn.Module, args: tuple) -> None:
        self.last = args[0].detach()

    def radius(self, quantile: float) -> Scalar:
        """The `quantile` of ‖h‖ over the last batch's tokens (a device tensor on CUDA: `host_scalar`)."""
        assert self.last is not None, "no forward pass seen yet"
        norms = self.last.float().flatten(0, -2).norm(dim=-1)
        return host_scalar(norms.max() if quantile >= 1 else torch.quantile(norms, quantile))


class LossReadback:
    """Each step's training loss, brought to the host without making the host wait for the device.

    On CUDA a loss is copied to pinned host memory asynchronously, behind an event; `arrived` returns the
    losses whose copies have completed, oldest first, waiting only when more than `max_unread` are in
    flight (or when asked to wait for all). A CPU loss has arrived as soon as it is pushed."""

    def __init__(self, max_unread: int = MAX_UNREAD_LOSSES) -> None:
        self.max_unread = max_unread
        self._in_flight: deque[tuple[int, torch.Tensor, torch.cuda.Event | None]] = deque()

    def push(self, step: int, loss: torch.Tensor) -> None:
        if loss.is_cuda:
            event = torch.cuda.Event()
            copy = loss.detach().to("cpu", non_blocking=True)  # into pinned memory: asynchronous
            event.record()
            self._in_flight.append((step, copy, event))
        else:
            self._in_flight.append((step, loss.detach(), None))

    def arrived(self, wait: bool = False) -> list[tuple[int, float]]:
        found = []
        while self._in_flight:
            step, copy, event = self._in_flight[0]
            if event is not None and not event.query():
                if not (wait or len(self._in_flight) > self.max_unread):
                    break
                event.synchronize()
            self._in_flight.popleft()
            found.append((step, float(copy)))
        return found


def rows_on_host(rows: list[dict]) -> list[dict]:
    """The rows with every device scalar a CUDA step left in them (a tau recipe's η_t) read in one transfer."""
    on_device = [(row, key) for row in rows for key, value in row.items() if isinstance(value, torch.Tensor)]
    if on_device:
        values = torch.stack([row[key].float().reshape(()) for row, key in on_device]).tolist()
        for (row, key), value in zip(on_device, values, strict=True):
            row[key] = value
    return rows


def training_forward(model: torch.nn.Module, device: torch.device, compile: bool) -> Callable[..., Any]:
    """What a training step calls: on the CPU the model itself; on CUDA the model with the fused loss, and
    compiled where `train.compile` asks (after `HeadInputs` is registered, so the hook is compiled in)."""
    if device.type != "cuda":
        return model
    use_fused_loss(model)
    return torch.compile(model) if compile else model


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: torch.Tensor, autocast: Callable) -> float:
    model.eval()
    losses = []
    for batch in batches.split(max(1, len(batches) // 4)):
        with autocast():
            losses.append(float(model(input_ids=batch, labels=batch).loss))
    model.train()
    return float(np.mean(losses))


@torch.no_grad()
def head_step_geometry(
    delta: torch.Tensor,
    grad: torch.Tensor,
    probe_h: torch.Tensor,
    train_h: torch.Tensor,
    cfg: TrainConfig,
    equi_rows: torch.Tensor,
) -> dict[str, float | bool | None]:
    """SPEC §3.3 geometry of the realised head update ΔW: on the probe batch's final hidden states, on the
    training batch's (`train_h`, the batch the step was computed from), and against its gradient `grad`."""
    delta = delta.float()
    if not bool(torch.isfinite(delta).all()):
        raise NumericBlowUp("the head update is not finite")
    sampled = delta.shape[0] > cfg.diam_exact_max_rows
    if sampled:
        diam = hilbert.diam_sampled(delta, cfg.diam_exact_max_rows, seed=0)
    else:
        diam = hilbert.diam(delta)[0]  # type: ignore[assignment]
    h = probe_h.float().flatten(0, -2)
    realized = float(hilbert.osc(h @ delta.T).max())
    bound = float(h.norm(dim=-1).max()) * float(diam)
    if not (math.isfinite(realized) and math.isfinite(bound)):
        raise NumericBlowUp(f"hilbert_realized {realized:.6g}, hilbert_bound {bound:.6g}")
    if not sampled and realized > bound * (1 + INVARIANT_RTOL) + 1e-7:
        raise InvariantViolated(f"hilbert_realized {realized:.6g} > hilbert_bound {bound:.6g}")
    small = delta.numel() <= 4_000_000  # the spectral norm is optional; skip it where it costs
    return {
        "head_diam": float(diam),
        "head_diam_sampled": sampled,
        "head_update_rms": float(delta.pow(2).mean().sqrt()),
        "head_update_spectral": float(torch.linalg.matrix_norm(delta, ord=2)) if small else None,
        "hilbert_realized": realized,
        "hilbert_bound": bound,
        "hilbert_realized_train": float(hilbert.osc(train_h.float().flatten(0, -2) @ delta.T).max()),
        "equi_ratio": float(hilbert.equi_ratio(delta[equi_rows])),
        **head_alignment(grad.float(), delta, float(diam)),
    }


def head_alignment(grad: torch.Tensor, delta: torch.Tensor, diameter: float) -> dict[str, float | None]:
    """How much the step descends along the gradient, normalised two ways (SPEC §3.3):
    `head_alignment`, the cosine of ΔW with −G; `head_alignment_hilbert`, the descent −⟨G, ΔW⟩ per unit of
    diameter relative to the `hilbert` LMO's, ½·Σ_i ‖g̃_i‖ (g̃ the centred rows): 1 for the `hilbert`
    step of G itself, and at most 1/Jung = √(2d/(d+1)) for any step. Null where a norm is zero."""
    descent = -float((grad * delta).sum())
    norms = float(grad.norm()) * float(delta.norm())
    per_unit_diam = 0.5 * diameter * float(center_rows(grad).norm(dim=1).sum())
    return {
        "head_alignment": descent / norms if norms > 0 else None,
        "head_alignment_hilbert": descent / per_unit_diam if per_unit_diam > 0 else None,
    }


def head_budget(cfg: TrainConfig, spec: RunSpec) -> float | None:
    """The budget (nats) `spec`'s head steps are matched to: its own, for a run of the matched-budget sweep,
    else none."""
    if spec.cap is None:
        return None
    if cfg.matched_budget is None or spec.cap not in cfg.matched_budget.taus:
        raise ValueError(f"{spec.run_id} is matched to {spec.cap:g} nats, but train.matched_budget.taus lacks it")
    return spec.cap


def train_run(
    spec: RunSpec,
    cfg: TrainConfig,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    vocab_size: int,
    seq_len: int,
    params_hash: str,
    save_checkpoint: Callable[[torch.nn.Module, str, dict], None],
    on_step: Callable[[int, float], None] | None = None,
    test_tokens: np.ndarray | None = None,
) -> tuple[RunRecord, pa.Table]:
    """Train one run; returns its summary and the per-step table. Checkpoints go through the callback
    (`init` before the first step, `final` after the last or at divergence). The final test loss is
    measured only when `test_tokens` are given (tuning never passes them)."""
    torch.manual_seed(spec.seed)
    device = pick_device(cfg.device)
    cuda = device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext

    model = build_model(spec.arch, cfg.model, vocab_size, seq_len, spec.seed).to(device)  # type: ignore[arg-type]
    head = head_of(model)
    head_budget_tau = head_budget(cfg, spec)
    optimizer = build_optimizers(model, head.weight, spec.recipe, cfg, head_budget_tau=head_budget_tau)  # type: ignore[arg-type]
    head_inputs = HeadInputs(head)
    forward = training_forward(model, device, cfg.compile)

    train_windows, val_windows = Windows(train_tokens, seq_len, device), Windows(val_tokens, seq_len, device)
    val_batches = val_windows.fixed(cfg.eval_batches * cfg.batch_size)
    probe = val_windows.fixed(cfg.probe_sequences)
    gen = torch.Generator().manual_seed(spec.seed)
    equi_rows = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))[: cfg.equi_sample_rows]
    # The most any rows of the sample's shape can spread; random unit rows of that shape are drawn afresh
    # at every geometry step (seeded by the step), so their spread is a distribution, not one draw.
    spread_bound = hilbert.equi_ratio_bound(len(equi_rows), cfg.model.d_model)
    radius_quantile = optimizer.radius_quantile

    save_checkpoint(model, "init", {"run": spec.run_id, "checkpoint": "init", "step": 0})
    rows: list[dict] = []
    val_loss = math.nan
    diverged_at: int | None = None
    losses = LossReadback()

    def record_losses(arrived: list[tuple[int, float]]) -> int | None:
        """Each arrived loss into its step's row (where the row exists yet) and to `on_step`, up to the
        first non-finite one, whose step is returned."""
        for done, value in arrived:
            if not math.isfinite(value):
                return done
            if done <= len(rows):
                rows[done - 1]["train_loss"] = value
            if on_step is not None:
                on_step(done, value)
        return None

    for step in range(1, cfg.steps + 1):
        batch = train_windows.random(cfg.batch_size, gen)
        with autocast():
            loss = forward(input_ids=batch, labels=batch).loss
        geometry_step = step % cfg.geometry_interval == 0 or step == 1
        losses.push(step, loss)
        # On the CPU this step's loss, checked before its backward. On CUDA what has arrived, and every
        # loss before a geometry step (which waits for the device anyway), so no geometry is measured on
        # the weights of a run that has diverged.
        arrived = losses.arrived(wait=geometry_step)
        diverged_at = next((done for done, value in arrived if not math.isfinite(value)), None)
        if diverged_at is not None:
            break
        loss.backward()
        if cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        radius = head_inputs.radius(radius_quantile)  # of this batch, for the `tau` trust region
        if geometry_step:
            assert head.weight.grad is not None and head_inputs.last is not None  # after a forward and backward
            w_before, grad, train_h = head.weight.detach().clone(), head.weight.grad.detach().clone(), head_inputs.last
            with torch.no_grad(), autocast():
                model(input_ids=probe)  # the probe's final hidden states, before this step
            probe_h = head_inputs.last
        optimizer.step(radius=radius)
        optimizer.zero_grad()
        row = {
            "step": step,
            "tokens": step * cfg.batch_size * seq_len,
            "lr": optimizer.head_lr(),
            "train_loss": None,
            "head_step_scale": optimizer.last_head_scale,
        }
        if geometry_step:
            delta = head.weight.detach() - w_before
            try:
                geometry = head_step_geometry(delta, grad, probe_h, train_h, cfg, equi_rows)
            except NumericBlowUp:  # before the invariant: a blown-up step diverges the run, it is no bug
                diverged_at = step
                break
            row |= geometry | {
                "equi_ratio_random": hilbert.equi_ratio_random(len(equi_rows), cfg.model.d_model, seed=step),
                "equi_ratio_bound": spread_bound,
            }
        if step % cfg.eval_interval == 0 or step == cfg.steps:
            val_loss = evaluate(model, val_batches, autocast)
            row["val_loss"] = val_loss
        rows.append(row)
        record_losses(arrived)
    if diverged_at is None:
        diverged_at = record_losses(losses.arrived(wait=True))  # on CUDA, the last steps' losses
    else:
        record_losses([item for item in arrived if item[0] < diverged_at])
    if diverged_at is not None:
        del rows[diverged_at - 1 :]
    rows_on_host(rows)
    train_loss = rows[-1]["train_loss"] if rows else math.nan

    diverged = diverged_at is not None
    test_loss = None
    if test_tokens is not None and not diverged:
        test_batches = Windows(test_tokens, seq_len, device).fixed(cfg.test_batches * cfg.batch_size)
        test_loss = evaluate(model, test_batches, autocast)
    result = RunRecord(
        run=spec.run_id,
        arch=spec.arch,
        recipe=spec.recipe,
        seed=spec.seed,
        steps=cfg.steps,
        steps_done=len(rows),
        tokens=len(rows) * cfg.batch_size * seq_len,
        final_train_loss=None if diverged else train_loss,
        final_val_loss=None if diverged else val_loss,
        final_test_loss=test_loss,
        head_step=optimizer.head_step.describe(),
        head_budget_tau=head_budget_tau,
        diverged=diverged,
        diverged_at_step=diverged_at,
        n_params=sum(p.numel() for p in model.parameters()),
        params_hash=params_hash,
    )
    save_checkpoint(model, "final", {"checkpoint": "final", **asdict(result)})
    return result, pa.Table.from_pylist(rows, schema=STEPS.file_schema())
