"""Verify, on the loaded model, that its resolved structure means what Study A assumes (SPEC §1, §4.1).

Resolution (`lmgeo.models.structure`) only reads the module tree; these checks run the model on a
short seeded probe and compare what flows through it, so that a model is analysed only when `h_0 … h_L`
are what the tables say they are:

1. `blocks`: each block runs exactly once per forward, in list order, on and to hidden states of the
   same shape;
2. `chaining`: block `l`'s output is block `l+1`'s input (nothing else touches the stream in between);
3. `last state`: the final norm receives exactly the last block's output (so `h_L` is before the norm);
4. `readout`: the final norm, the head and the family's documented logit map applied to that state
   reproduce the model's logits;
5. `extraction`: the states extraction captures (through the base model, without the head) equal those
   of the full forward;
6. `patching`: a vector written into block `l`'s output by a forward hook (how patching works) is what
   block `l+1` receives.

A failed check raises `VerificationFailed` naming it; nothing is analysed silently wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from lmgeo.core.errors import InputError
from lmgeo.models.hooks import block_input, block_output, eval_mode, hooks, model_device, with_hidden
from lmgeo.models.registry import blocks_of, final_norm_of, head_of, logits_from_last_state, structure_of
from lmgeo.models.structure import Structure
from lmgeo.study_a.extract import capture_states

CHECKS = ("blocks", "chaining", "last state", "readout", "extraction", "patching")
PROBE_SEQUENCES, PROBE_LENGTH, PROBE_SEED = 2, 12, 0
# Largest relative difference (to the largest magnitude compared) still counted as equal. The same
# operations on the same inputs agree far closer; a wrong structure misses by O(1).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


class VerificationFailed(InputError):
    """The model's structure does not mean what Study A assumes; the message names the failed check."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"verification failed: {check}: {detail}")
        self.check, self.detail = check, detail

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # rebuilt from both arguments across Ray
        return type(self), (self.check, self.detail)


@dataclass(frozen=True)
class Verified:
    structure: Structure
    n_blocks: int
    width: int
    max_error: dict[str, float]  # per numeric check, the relative difference measured


def probe_ids(model: PreTrainedModel) -> torch.Tensor:
    """A seeded batch of token ids valid for both the embedding and the head."""
    vocab = min(model.get_input_embeddings().num_embeddings, head_of(model).out_features)  # type: ignore[type-var]
    generator = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(0, vocab, (PROBE_SEQUENCES, PROBE_LENGTH), generator=generator)  # type: ignore[arg-type]
    return ids.to(model_device(model))


def verify_model(model: PreTrainedModel) -> Verified:
    """Run every check on `model` (in eval mode, without gradients); raise `VerificationFailed` at the first
    that fails."""
    structure = structure_of(model)  # a StructureError (no blocks, norm or head) comes first
    ids = probe_ids(model)
    with eval_mode(model), torch.inference_mode():
        trace = _trace(model, ids)
        errors = {
            "chaining": _check_blocks_and_chaining(trace, len(blocks_of(model))),
            "last state": _check_last_state(trace),
            "readout": _check_readout(model, trace),
            "extraction": _check_extraction(model, ids, trace),
            "patching": _check_patching(model, ids, trace),
        }
    return Verified(structure, len(blocks_of(model)), trace.inputs[0][1].shape[-1], errors)


# ------------------------------------------------------------------------------------------ the probe
@dataclass
class _Trace:
    inputs: list[tuple[int, torch.Tensor]]  # (block index, its input), in call order
    outputs: list[tuple[int, torch.Tensor]]
    norm_inputs: list[torch.Tensor]  # the final norm's inputs after the last block returned
    logits: torch.Tensor


def _trace(model: PreTrainedModel, ids: torch.Tensor) -> _Trace:
    """One full forward, recording (copies of) every block's input and output and what the final norm
    receives after the last block (some families also norm the embeddings with the same module):
    copies, because a block that updates a tensor in place would otherwise rewrite what was recorded."""
    trace = _Trace([], [], [], torch.empty(0))
    blocks = blocks_of(model)

    def on_input(index: int) -> Callable[..., None]:
        return lambda _m, args, kwargs: trace.inputs.append((index, block_input(args, kwargs).clone()))

    def on_output(index: int) -> Callable[..., None]:
        return lambda _m, _args, output: trace.outputs.append((index, block_output(output).clone()))

    def on_norm(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if any(index == len(blocks) - 1 for index, _ in trace.outputs):
            trace.norm_inputs.append(block_input(args, kwargs).clone())

    handles = [final_norm_of(model).register_forward_pre_hook(on_norm, with_kwargs=True)]
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(on_input(index), with_kwargs=True))
        handles.append(block.register_forward_hook(on_output(index)))
    with hooks(*handles):
        trace.logits = model(input_ids=ids, use_cache=False).logits
    if not bool(torch.isfinite(trace.logits).all()):
        raise VerificationFailed("readout", "the model's logits on the probe are not finite")
    return trace


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.shape != expected.shape:
        return float("inf")
    scale = expected.abs().max().clamp_min(torch.finfo(expected.dtype).tiny)
    return float((actual.float() - expected.float()).abs().max() / scale.float())


def _require_close(check: str, what: str, actual: torch.Tensor, expected: torch.Tensor) -> float:
    error = _relative_error(actual, expected)
    tolerance = TOLERANCE.get(expected.dtype, 1e-4)
    if not error <= tolerance:
        shapes = ""
        if actual.shape != expected.shape:
            shapes = f" (shapes {tuple(actual.shape)} and {tuple(expected.shape)})"
        raise VerificationFailed(check, f"{what}: relative difference {error:.3g} > {tolerance:g}{shapes}")
    return error


# ------------------------------------------------------------------------------------------ the checks
def _check_blocks_and_chaining(trace: _Trace, n_blocks: int) -> float:
    order = list(range(n_blocks))
    for kind, calls in (("inputs", trace.inputs), ("outputs", trace.outputs)):
        seen = [index for index, _ in calls]
        if seen != order:
            raise VerificationFailed(
                "blocks", f"block {kind} were seen in the order {seen[:12]}, not once each in order {order[:12]}"
            )
    shape = trace.inputs[0][1].shape
    for index, h in trace.inputs + trace.outputs:
        if h.shape != shape:
            raise VerificationFailed(
                "blocks", f"block {index} takes or returns shape {tuple(h.shape)}, not {tuple(shape)}"
            )
    worst = 0.0
    for layer in range(n_blocks - 1):
        worst = max(
            worst,
            _require_close(
                "chaining",
                f"block {layer}'s output vs block {layer + 1}'s input",
                trace.outputs[layer][1],
                trace.inputs[layer + 1][1],
            ),
        )
    return worst


def _check_last_state(trace: _Trace) -> float:
    if len(trace.norm_inputs) != 1:
        raise VerificationFailed(
            "last state", f"the final norm ran {len(trace.norm_inputs)} times after the last block, not once"
        )
    return _require_close(
        "last state", "the final norm's input vs the last block's output", trace.norm_inputs[0], trace.outputs[-1][1]
    )


def _check_readout(model: PreTrainedModel, trace: _Trace) -> float:
    rebuilt = logits_from_last_state(model, trace.outputs[-1][1])
    return _require_close(
        "readout", "final norm + head + logit map on the last state vs the logits", rebuilt, trace.logits
    )


def _check_extraction(model: PreTrainedModel, ids: torch.Tensor, trace: _Trace) -> float:
    expected = [h for _, h in trace.inputs] + [trace.outputs[-1][1]]
    captured = capture_states(model, ids)
    worst = 0.0
    for layer, (got, want) in enumerate(zip(captured, expected, strict=True)):
        worst = max(worst, _require_close("extraction", f"extracted h_{layer} vs the full forward's", got, want))
    return worst


def _check_patching(model: PreTrainedModel, ids: torch.Tensor, trace: _Trace) -> float:
    """Write a distinct vector into block `l`'s output at one token by a forward hook; what runs next
    (block `l+1`, or the final norm after the last block) must receive exactly it there, and the rest of
    the output unchanged."""
    layer, pos = 0, PROBE_LENGTH // 2
    original = trace.outputs[layer][1]
    patched = original.clone()
    patched[0, pos] = -2 * original[0, pos] + 1
    received: list[torch.Tensor] = []

    def replace(_m: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
        received.clear()  # what ran next before this block (an embedding norm) does not count
        return with_hidden(output, patched)

    def record(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        received.append(block_input(args, kwargs).clone())

    blocks = blocks_of(model)
    after = blocks[layer + 1] if len(blocks) > 1 else final_norm_of(model)
    with hooks(after.register_forward_pre_hook(record, with_kwargs=True), blocks[layer].register_forward_hook(replace)):
        model(input_ids=ids, use_cache=False)
    if len(received) != 1:
        raise VerificationFailed("patching", f"what follows block {layer} ran {len(received)} times after it")
    return _require_close(
        "patching", f"what follows block {layer} received vs the patched output", received[0], patched
    )
