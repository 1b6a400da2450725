"""The next-token loss of a CUDA training step, computed from the bf16 logits that autocast gives.

transformers' causal-LM loss first copies the whole `(batch · seq_len) × V` logits to float32, then takes
the log-softmax and its gradient through that copy: at GPT-2 small's shape (8 × 1,024 tokens, V = 50,304)
412 M logits, 1.6 GB written and read back in each direction, most of the ~7.6 ms an H200 step spent in
`aten::copy_`. Here the same cross-entropy is one compiled function (`torch.compile`): the upcast is fused
into the log-sum-exp reduction and into the gradient, so no float32 logits are ever stored (the bf16 logits
and one log-sum-exp per row are what the backward keeps), and no chunking is needed to bound memory.

It is the same function: a bf16 value's float32 upcast is exact, and both sum in float32; only the order of
the sums differs. The CPU never uses it (its logits are float32 and its loss is the model's own, the path
the study's results come from).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def next_token_loss(logits: Tensor, labels: Tensor, vocab_size: int | None = None, **kwargs: object) -> Tensor:
    """Mean cross-entropy of each position's logits against the next label, as transformers'
    `ForCausalLMLoss` computes it (labels −100 ignored), without its float32 copy of the logits. Takes the
    arguments a model passes its `loss_function`."""
    if kwargs.get("num_items_in_batch") is not None or kwargs.get("shift_labels") is not None:
        raise NotImplementedError("next_token_loss takes whole sequences and a mean over their tokens only")
    del vocab_size  # the logits' last dimension
    predicted = logits[:, :-1].reshape(-1, logits.size(-1))
    return F.cross_entropy(predicted.float(), labels[:, 1:].reshape(-1), ignore_index=-100)


@functools.cache
def fused_next_token_loss() -> Callable[..., Tensor]:
    """`next_token_loss` compiled (one process-wide compilation cache; Inductor also caches it on disk)."""
    return torch.compile(next_token_loss)


def use_fused_loss(model: nn.Module) -> None:
    """Make `model(input_ids=…, labels=…).loss` the compiled `next_token_loss` (transformers' models call
    their `loss_function` with the logits they computed). For CUDA models trained under bf16 autocast."""
    model.loss_function = fused_next_token_loss()  # type: ignore[assignment]
