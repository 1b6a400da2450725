"""Forward hooks on a model's blocks, and the context managers that keep them from leaking."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def block_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The hidden states a block receives: positional in transformers 5, by keyword in some remote code."""
    return args[0] if args else kwargs["hidden_states"]


def block_output(output: Any) -> torch.Tensor:
    """The hidden states a block returns: a tensor in transformers 5, a tuple's first entry in older code."""
    return output[0] if isinstance(output, tuple) else output


def with_hidden(output: Any, hidden: torch.Tensor) -> Any:
    """A block's output with its hidden states replaced (what a forward hook returns to patch it)."""
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Dropout off for the duration, restoring the caller's mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def hooks(*handles: torch.utils.hooks.RemovableHandle) -> Iterator[None]:
    """Remove the hooks however the forward ends: a leftover hook would corrupt every later forward."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
