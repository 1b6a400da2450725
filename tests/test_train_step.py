"""The CUDA training step's parts, checked on the CPU (issue #39): the fused next-token loss, the losses read
back from the device late, the head step with its radius left on the device, and the optimizers each path
builds. On CUDA they are exercised by `make gpu-check`; here every function is run on CPU tensors, and the
CPU path itself is pinned bit for bit by tests/test_pinned_training.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

import lmgeo.study_b.train as train_module
from lmgeo.core.contracts import RunSpec
from lmgeo.models.config import ModelSize
from lmgeo.models.registry import build_model, head_of
from lmgeo.study_b.config import RecipeConfig, TrainConfig
from lmgeo.study_b.loss import fused_next_token_loss, next_token_loss, use_fused_loss
from lmgeo.study_b.optim import HeadLMO, build_optimizers, host_scalar
from lmgeo.study_b.recipes import RECIPES
from lmgeo.study_b.recipes.base import LMOKnobs
from lmgeo.study_b.train import LossReadback, rows_on_host, train_run

TINY = ModelSize(d_model=16, n_layers=1, n_heads=2)
VOCAB, SEQ = 64, 16


def logits_and_labels(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(3, 9, 50, generator=gen)).bfloat16()
    labels = torch.randint(0, 50, (3, 9), generator=gen)
    labels[1, 4] = -100  # ignored, as transformers ignores it
    return logits, labels


def exact_next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The mean over predicted positions of −log softmax(z_t)[y_{t+1}], in float64, written out."""
    z, y = logits[:, :-1].double(), labels[:, 1:]
    log_probs = z - z.logsumexp(dim=-1, keepdim=True)
    keep = y != -100
    return float(-log_probs[keep].gather(1, y[keep][:, None]).mean())


# --------------------------------------------------------------------------------------- the loss
def test_the_loss_on_bf16_logits_is_transformers_loss_and_the_exact_one() -> None:
    logits, labels = logits_and_labels()
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    loss = next_token_loss(ours, labels, vocab_size=50)
    reference = ForCausalLMLoss(theirs, labels, vocab_size=50)  # copies the logits to float32 first
    assert loss.item() == pytest.approx(exact_next_token_loss(logits, labels), rel=1e-6)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)  # only the order of float32 sums differs
    loss.backward()
    reference.backward()
    assert ours.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours.grad, theirs.grad)


def test_the_loss_refuses_what_it_does_not_compute() -> None:
    logits, labels = logits_and_labels()
    with pytest.raises(NotImplementedError):
        next_token_loss(logits, labels, num_items_in_batch=torch.tensor(7))


@pytest.mark.slow  # compiles with Inductor's CPU backend (~20-60 s on a loaded 2-core machine)
def test_the_compiled_loss_keeps_bf16_logits_and_row_statistics_only() -> None:
    """What the backward keeps: the eager loss saves float32 copies of the logits (the `aten::copy_`
    traffic on CUDA); the compiled one saves the bf16 logits and a few numbers per row, and computes the
    same loss and gradient. The partitioner that decides this is the same for Inductor's CPU and CUDA
    backends."""
    logits, labels = logits_and_labels(seed=1)

    def run(fn) -> tuple[float, torch.Tensor, list[tuple[torch.dtype, int]]]:
        x = logits.clone().requires_grad_()
        saved = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append((t.dtype, t.numel()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn(x, labels)
        loss.backward()
        return loss.item(), x.grad, saved

    eager_loss, eager_grad, eager_saved = run(next_token_loss)
    fused_loss, fused_grad, fused_saved = run(fused_next_token_loss())
    assert fused_loss == pytest.approx(eager_loss, rel=1e-6)
    torch.testing.assert_close(fused_grad, eager_grad)
    rows, size = 3 * 8, logits.numel()
    assert any(dtype == torch.float32 and n >= rows * 50 for dtype, n in eager_saved)
    assert [n for dtype, n in fused_saved if dtype.is_floating_point and n > rows] == [size]  # the bf16 logits
    assert all(dtype == torch.bfloat16 for dtype, n in fused_saved if n == size)


def test_a_model_given_the_fused_loss_returns_it() -> None:
    model = build_model("neox", TINY, VOCAB, SEQ, seed=0)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    own = model(input_ids=ids, labels=ids).loss.item()
    model.loss_function = next_token_loss  # what use_fused_loss installs, uncompiled
    assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(own, rel=1e-6)
    use_fused_loss(model)
    assert model.loss_function is fused_next_token_loss()


# -------------------------------------------------------------------------------- losses read late
class LateReadback(LossReadback):
    """CUDA's readback as the loop sees it on a slow device: each loss arrives `lag` steps after its step."""

    lag = 3

    def arrived(self, wait: bool = False) -> list[tuple[int, float]]:
        newest = self._in_flight[-1][0] if self._in_flight else 0
        found = []
        while self._in_flight and (wait or self._in_flight[0][0] <= newest - self.lag):
            step, copy, _ = self._in_flight.popleft()
            found.append((step, float(copy)))
        return found


def test_a_readback_returns_every_loss_once_in_order() -> None:
    readback = LossReadback()
    for step, value in enumerate([2.5, 2.25, math.nan], start=1):
        readback.push(step, torch.tensor(value))
    arrived = readback.arrived()
    assert arrived[:2] == [(1, 2.5), (2, 2.25)] and math.isnan(arrived[2][1])
    assert readback.arrived(wait=True) == []


def test_rows_on_host_reads_every_device_scalar_and_leaves_the_rest() -> None:
    rows = [{"step": 1, "lr": torch.tensor(0.25), "train_loss": 3.0}, {"step": 2, "lr": 0.5, "head_step_scale": None}]
    assert rows_on_host(rows) == [
        {"step": 1, "lr": 0.25, "train_loss": 3.0},
        {"step": 2, "lr": 0.5, "head_step_scale": None},
    ]


@pytest.fixture(scope="module")
def tokens() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {split: rng.integers(0, VOCAB, n).astype(np.int32) for split, n in (("train", 4000), ("val", 800))}


def train(tokens, monkeypatch, recipe: str = "hilbert", diverge_at: int | None = None, late: bool = False):
    """A tiny run; `diverge_at` plants a non-finite loss at that training step (NaN logits from the head);
    `late` reads the losses as a slow CUDA device delivers them."""
    if late:
        monkeypatch.setattr(train_module, "LossReadback", LateReadback)
    if diverge_at is not None:
        real_build = train_module.build_model

        def build_with_a_fault(*args, **kwargs):
            model = real_build(*args, **kwargs)
            calls = {"training": 0}

            def poison(module, inputs, output):
                if torch.is_grad_enabled():  # a training forward (the probe and evaluations run without grad)
                    calls["training"] += 1
                    if calls["training"] == diverge_at:
                        return output * math.nan
                return output

            head_of(model).register_forward_hook(poison)
            return model

        monkeypatch.setattr(train_module, "build_model", build_with_a_fault)
    cfg = TrainConfig(
        model=TINY,
        steps=8,
        batch_size=4,
        eval_interval=4,
        eval_batches=1,
        probe_sequences=2,
        geometry_interval=3,
        equi_sample_rows=32,
        device="cpu",
        recipe_overrides={"hilbert": RecipeConfig(tau=0.4)},
    )
    seen, finals = [], []

    def keep_final(model, name, info) -> None:
        if name == "final":
            finals.append({k: v.clone() for k, v in model.state_dict().items()})

    record, steps = train_run(
        RunSpec("neox", recipe, 0),
        cfg,
        tokens["train"],
        tokens["val"],
        VOCAB,
        SEQ,
        "x",
        keep_final,
        on_step=lambda step, loss: seen.append((step, loss)),
    )
    return record, steps.to_pylist(), seen, finals[0]


@pytest.mark.slow
def test_losses_read_late_record_the_same_run(tokens, monkeypatch) -> None:
    """CUDA's bookkeeping (losses arriving steps after their step, rows filled in later) against the CPU's
    (each loss read at once): the same rows, the same calls of `on_step`, the same model."""
    at_once = train(tokens, monkeypatch)
    late = train(tokens, monkeypatch, late=True)
    assert late[0] == at_once[0] and late[1] == at_once[1] and late[2] == at_once[2]
    assert all(torch.equal(late[3][k], at_once[3][k]) for k in at_once[3])
    assert [step for step, _ in at_once[2]] == list(range(1, 9))


@pytest.mark.slow
def test_a_divergence_is_recorded_at_its_step_read_at_once_or_late(tokens, monkeypatch) -> None:
    # `muon`: no radius to check on the host, which on CUDA stays on the device unchecked
    record, rows, seen, final = train(tokens, monkeypatch, "muon", diverge_at=5)
    assert (record.diverged, record.diverged_at_step, record.steps_done) == (True, 5, 4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [s for s, _ in seen] == [1, 2, 3, 4]
    assert record.final_train_loss is None and all(torch.isfinite(w).all() for w in final.values())
    late_record, late_rows, late_seen, late_final = train(tokens, monkeypatch, "muon", diverge_at=5, late=True)
    assert (late_record, late_rows, late_seen) == (record, rows, seen)
    # noticed 3 steps late, the late run took those steps on a non-finite gradient (documented for CUDA)
    assert not all(torch.isfinite(w).all() for w in late_final.values())


# ------------------------------------------------------------------ the head step, the optimizers
def test_a_radius_left_on_the_device_takes_the_same_tau_step() -> None:
    """The CUDA branch of a tau step (r_t and η_t tensors, `addcmul_`) against the CPU's (Python floats,
    `add_` with alpha), on CPU tensors: the same step to float32 rounding of η."""
    gen = torch.Generator().manual_seed(3)
    start, grad = torch.randn(40, 8, generator=gen), torch.randn(40, 8, generator=gen)
    direction = RECIPES["hilbert"].direction
    moved = []
    for radius in (2.5, torch.tensor(2.5)):
        weight = torch.nn.Parameter(start.clone())
        weight.grad = grad.clone()
        opt = HeadLMO([weight], direction, lr=0.4, knobs=LMOKnobs(3, 0.5), weight_decay=0.1, trust_region=True)
        opt.set_radius(radius)
        opt.step()
        moved.append((weight.detach().clone(), opt.last_eta))
    (on_host, eta_host), (on_device, eta_device) = moved
    assert isinstance(eta_host, float) and isinstance(eta_device, torch.Tensor)
    assert float(eta_device) == pytest.approx(eta_host, rel=1e-6)
    torch.testing.assert_close(on_device, on_host, rtol=1e-6, atol=1e-7)
    assert not torch.equal(on_host, start)


def test_a_radius_is_checked_on_the_host_only() -> None:
    weight = torch.nn.Parameter(torch.zeros(4, 2))
    opt = HeadLMO([weight], RECIPES["hilbert"].direction, lr=0.4, knobs=LMOKnobs(3, 0.5), trust_region=True)
    with pytest.raises(ValueError, match="positive and finite"):
        opt.set_radius(0.0)
    opt.set_radius(torch.tensor(0.0))  # would wait for the device: left to the loss check


def test_host_scalar_reads_a_cpu_tensor_and_cpu_runs_keep_the_single_tensor_adamw() -> None:
    value = host_scalar(torch.tensor(1.5))
    assert isinstance(value, float) and value == 1.5
    model = build_model("neox", TINY, VOCAB, SEQ, seed=0)
    optimizer = build_optimizers(model, head_of(model).weight, "adamw", TrainConfig(model=TINY))
    assert not optimizer.optimizers["adamw"].defaults["fused"]
