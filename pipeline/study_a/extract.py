"""Residual-stream representations h_0 … h_L of a causal LM, captured with hooks on the blocks (SPEC §4.1).

`h_l` is the input of block `l` and `h_L` the output of the last block *before* the final norm. The
`output_hidden_states` of transformers is not used: its last entry is final-normed for GPT-2/NeoX and
its entries for Mamba are block outputs, not inputs. The blocks are those `pipeline.models.structure`
resolves; `pipeline.study_a.verify` checks, per model, that these captures are the residual stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn
from transformers import PreTrainedModel

from pipeline.core.store import vectors_to_arrow
from pipeline.models.hooks import block_input, block_output, eval_mode, hooks, model_device
from pipeline.models.registry import blocks_of

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


def _layer_batch(seq_ids: np.ndarray, token_ids: np.ndarray, h: torch.Tensor, half: bool) -> pa.RecordBatch:
    n_seq, seq_len = token_ids.shape
    vectors = h.detach().to(device="cpu", dtype=torch.float32).reshape(n_seq * seq_len, -1).numpy()
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.repeat(seq_ids.astype(np.int32), seq_len)),
            pa.array(np.tile(np.arange(seq_len, dtype=np.int32), n_seq)),
            pa.array(token_ids.astype(np.int32).reshape(-1)),
            vectors_to_arrow(vectors, half=half),
        ],
        names=list(ACTIVATION_COLUMNS),
    )


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
    time, so peak memory does not grow with the number of sequences. The model must be on `device`
    (default: where its parameters are). `half` stores the vectors as float16 (SPEC §1 opt-in).
    """
    if token_ids.ndim != 2 or len(seq_ids) != len(token_ids):
        raise ValueError(f"token_ids {token_ids.shape} must be (n_seq, seq_len) with one seq_id per row")
    device = model_device(model) if device is None else torch.device(device)
    for start in range(0, len(token_ids), batch_size):
        tokens = token_ids[start : start + batch_size]
        input_ids = torch.as_tensor(tokens, dtype=torch.long, device=device)
        for layer, h in enumerate(capture_states(model, input_ids)):
            yield layer, _layer_batch(seq_ids[start : start + batch_size], tokens, h, half)
