"""Residual-stream representations h_0 … h_L of a causal LM, captured with hooks on the blocks (SPEC §4.1).

`h_l` is the input of block `l` and `h_L` the output of the last block *before* the final norm. The
`output_hidden_states` of transformers is not used: its last entry is final-normed for GPT-2/NeoX and
its entries for Mamba are block outputs, not inputs. The blocks are those `lmgeo.models.structure`
resolves; `lmgeo.study_a.verify` checks, per model, that these captures are the residual stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch
from torch import nn
from transformers import PreTrainedModel

from lmgeo.core.contracts import vectors_to_arrow
from lmgeo.models.hooks import block_input, block_output, eval_mode, hooks, model_device
from lmgeo.models.registry import blocks_of

ACTIVATION_COLUMNS = ("seq_id", "pos", "token_id", "h")


def capture_states(model: PreTrainedModel, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """[h_0, …, h_L], each (batch, seq_len, d), from one forward of the base model (the head is not needed).

    Copies, not references: a block that updates its input in place would otherwise rewrite a capture."""
    blocks = blocks_of(model)
    states: list[torch.Tensor] = []

    def save_input(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        states.append(block_input(args, kwargs).clone())

    def save_output(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        states.append(block_output(output).clone())

    handles = [block.register_forward_pre_hook(save_input, with_kwargs=True) for block in blocks]
    handles.append(blocks[-1].register_forward_hook(save_output))
    with hooks(*handles), eval_mode(model), torch.inference_mode():
        model.base_model(input_ids=input_ids, use_cache=False)
    if len(states) != len(blocks) + 1:
        raise RuntimeError(f"captured {len(states)} states for {len(blocks)} blocks; was a block skipped?")
    return states


class _OnHost(NamedTuple):
    """One batch's states on their way to host memory: `states` (batch, seq_len, d) each, readable once `ready`
    (None: already readable) has completed."""

    seq_ids: np.ndarray
    tokens: np.ndarray
    states: list[torch.Tensor]
    ready: torch.cuda.Event | None


class _DeviceToHost:
    """Copies of captured states to host memory. On CUDA: into pinned (page-locked) host memory, asynchronously,
    on a stream of their own, so that a batch's copies run while the next batch's forward computes (the DMA
    engine and the SMs work at once); on the CPU the states are host memory already and nothing is copied (any
    other device copies them, blocking).

    Pinned blocks come from torch's caching host allocator: one is reused only once the copy into it has
    completed and nothing refers to it any more, i.e. once the writer is done with the Arrow column that views it
    (the NumPy view keeps the tensor alive)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.in_flight = 0 if self.stream is None else 1  # batches whose rows wait for the next forward's launch

    def start(self, seq_ids: np.ndarray, tokens: np.ndarray, states: list[torch.Tensor]) -> _OnHost:
        if self.stream is None:  # `cpu()` copies from another device, and is the tensor itself on the CPU
            return _OnHost(seq_ids, tokens, [state.cpu() for state in states], None)
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # after the forward that made them
        on_host = []
        with torch.cuda.stream(self.stream):
            for state in states:
                state.record_stream(self.stream)  # its device memory is not reused before the copy is done
                host = torch.empty(state.shape, dtype=state.dtype, pin_memory=True)
                on_host.append(host.copy_(state, non_blocking=True))
        return _OnHost(seq_ids, tokens, on_host, self.stream.record_event())


def _rows(batch: _OnHost, half: bool) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(layer, rows) of one batch, rows ordered by (seq_id, pos); the vectors are views of the host states."""
    if batch.ready is not None:
        batch.ready.synchronize()
    n_seq, seq_len = batch.tokens.shape
    ids = [
        pa.array(np.repeat(batch.seq_ids.astype(np.int32), seq_len)),
        pa.array(np.tile(np.arange(seq_len, dtype=np.int32), n_seq)),
        pa.array(batch.tokens.astype(np.int32).reshape(-1)),
    ]
    for layer, h in enumerate(batch.states):
        vectors = vectors_to_arrow(h.reshape(n_seq * seq_len, -1).numpy(), half=half)
        yield layer, pa.RecordBatch.from_arrays([*ids, vectors], names=list(ACTIVATION_COLUMNS))


def extract_batches(
    model: PreTrainedModel,
    token_ids: np.ndarray,
    seq_ids: np.ndarray,
    batch_size: int,
    device: torch.device | str | None = None,
    half: bool = False,
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Yield (layer, rows) for layers 0..L of each batch of sequences, rows ordered by (seq_id, pos).

    `token_ids` is (n_seq, seq_len); `seq_ids` names each row. One batch of sequences is in memory at a
    time (two on CUDA: a batch's rows are yielded once the next batch's forward has been launched, so its
    copy to the host overlaps that forward), so peak memory does not grow with the number of sequences. The
    model must be on `device` (default: where its parameters are). `half` stores the vectors as float16
    (SPEC §1 opt-in), converted on the device, so half as many bytes cross to the host.
    """
    if token_ids.ndim != 2 or len(seq_ids) != len(token_ids):
        raise ValueError(f"token_ids {token_ids.shape} must be (n_seq, seq_len) with one seq_id per row")
    device = model_device(model) if device is None else torch.device(device)
    dtype = torch.float16 if half else torch.float32
    to_host = _DeviceToHost(device)
    pending: deque[_OnHost] = deque()
    for start in range(0, len(token_ids), batch_size):
        tokens = token_ids[start : start + batch_size]
        input_ids = torch.as_tensor(tokens, dtype=torch.long)
        input_ids = input_ids.pin_memory() if to_host.stream is not None else input_ids
        states = [h.to(dtype) for h in capture_states(model, input_ids.to(device, non_blocking=True))]
        pending.append(to_host.start(seq_ids[start : start + batch_size], tokens, states))
        while len(pending) > to_host.in_flight:
            yield from _rows(pending.popleft(), half)
    while pending:
        yield from _rows(pending.popleft(), half)
