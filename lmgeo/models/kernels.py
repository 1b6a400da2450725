"""Which implementation of Mamba's scan and convolution runs: mamba-ssm's and causal-conv1d's CUDA kernels
where they are installed, transformers' PyTorch reference otherwise, chosen per call by the device.

How transformers picks them (5.x, `integrations.hub_kernels.use_kernel_func_from_hub_with_fallback`): once,
when `transformers.models.mamba.modeling_mamba` is imported, each of its five kernel functions
(`mamba_inner_fn`, `causal_conv1d_fn`, `causal_conv1d_update`, `mamba_selective_scan`,
`mamba_selective_state_update`) tries to import its package (`mamba_ssm`, `causal_conv1d`); where that
succeeds, every later call goes to the kernel, whatever device the tensors are on, and where it fails, to
the PyTorch code the function wraps. In training, `MambaMixer` calls `mamba_inner_fn` (the whole mixer in
one fused kernel); in evaluation, extraction and patching (eval mode, with or without a recurrent cache)
`causal_conv1d_fn`/`_update` and the selective scan or its one-token state update, the kernels of the same
packages. Our hooks sit on the blocks' inputs and outputs (`lmgeo.models.hooks`), outside the mixer, so
extraction and patching see the same residual stream on either path.

A CPU model in a process that has the kernels (the GPU check's CPU side; `train.device: cpu` on a CUDA node
installed with `lmgeo[gpu]`) would then call a CUDA-only kernel. So where a kernel package is importable,
`route_mamba_kernels` replaces each of the five module-level functions by one that sends CUDA tensors to
transformers' choice and anything else to the reference it wraps. Where neither package is importable
(every CPU machine) nothing is touched, and the module is not even imported here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

MAMBA_MODULE = "transformers.models.mamba.modeling_mamba"
KERNEL_PACKAGES = ("mamba_ssm", "causal_conv1d")
KERNEL_FUNCTIONS = (
    "mamba_inner_fn",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba_selective_scan",
    "mamba_selective_state_update",
)
_ROUTED = "__lmgeo_routed__"
_kernels_on = True  # `use_mamba_kernels(False)`: the reference on CUDA too


def kernel_packages() -> dict[str, bool]:
    """Whether each kernel package can be imported here (found, not imported)."""
    return {name: importlib.util.find_spec(name) is not None for name in KERNEL_PACKAGES}


def by_device(chosen: Callable[..., Any]) -> Callable[..., Any]:
    """`chosen` (transformers' function, calling a kernel or its reference) for CUDA tensors, the reference
    it wraps (`__wrapped__`) for any other first argument, or for CUDA too inside `use_mamba_kernels(False)`."""
    reference = chosen.__wrapped__  # type: ignore[attr-defined]  # set by functools.wraps in transformers

    @functools.wraps(reference)
    def routed(*args: Any, **kwargs: Any) -> Any:
        on_cuda = bool(getattr(args[0], "is_cuda", False))
        return (chosen if on_cuda and _kernels_on else reference)(*args, **kwargs)

    setattr(routed, _ROUTED, chosen)
    return routed


def route_mamba_kernels() -> None:
    """Route transformers' Mamba kernel functions by device (module docstring); idempotent, and a no-op
    where no kernel package is importable."""
    if not any(kernel_packages().values()):
        return
    module = importlib.import_module(MAMBA_MODULE)
    for name in KERNEL_FUNCTIONS:
        function = getattr(module, name)
        if not hasattr(function, _ROUTED):
            setattr(module, name, by_device(function))


def implementations() -> dict[str, str]:
    """For each kernel function, the implementation transformers chose for CUDA tensors (`module.name`):
    a kernel package's, or `transformers…` for its reference."""
    module = importlib.import_module(MAMBA_MODULE)
    found = {}
    for name in KERNEL_FUNCTIONS:
        function = getattr(module, name)
        chosen = getattr(function, _ROUTED, function)
        implementation = inspect.getclosurevars(chosen).nonlocals.get("implementation", chosen)
        found[name] = f"{implementation.__module__}.{implementation.__qualname__}"
    return found


def kernels_chosen() -> bool:
    """Whether transformers chose a kernel package's implementation for every one of the five functions."""
    return all(path.startswith(KERNEL_PACKAGES) for path in implementations().values())


@contextmanager
def use_mamba_kernels(enabled: bool) -> Iterator[None]:
    """Within the block, CUDA tensors go to the kernels (`True`, the default) or to the reference (`False`):
    how the GPU check compares the two paths on one device."""
    global _kernels_on
    before, _kernels_on = _kernels_on, enabled
    try:
        yield
    finally:
        _kernels_on = before
