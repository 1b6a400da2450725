"""Does the library import and run its private-API calls with this machine's packages? The CUDA machine has
torch 2.11 and transformers 5.17 where the pins say 2.13 and 5.24, and no Ray, DVC or DuckDB: this says
exactly which module fails to import and why, and whether the private torch names the library uses are
there with the signature it calls."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import platform
import traceback
from importlib import metadata
from typing import Any

from scripts.gpucheck.summary import Outcome

# Too big to travel to the CUDA machine (Ray's wheel alone is 79 MB) and not needed by the library path
# the check runs: a module that needs one of them is reported as such, not as a failure.
NOT_CARRIED = ("ray", "dvc", "duckdb")
PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "pyarrow",
    "scipy",
    "pydantic",
    "pydantic-core",
    "typing-extensions",
    "mambapy",
    "mamba-ssm",
    "causal-conv1d",
    "triton",
    "pytest",
)


def versions() -> dict[str, str]:
    import torch

    found = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    found["torch cuda"] = str(torch.version.cuda)
    found["tf32 matmul / cudnn"] = f"{torch.backends.cuda.matmul.allow_tf32} / {torch.backends.cudnn.allow_tf32}"
    return found


def device_facts() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False}
    props = torch.cuda.get_device_properties(0)
    return {
        "cuda": True,
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "bf16": torch.cuda.is_bf16_supported(),
    }


def import_every_module(package: str = "lmgeo") -> Outcome:
    """Import each module of the library; a failure is `not carried` when it needs only a package listed
    in NOT_CARRIED, else an error with its message."""
    root = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.walk_packages(root.__path__, f"{package}."))
    not_carried, failed = {}, {}
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            missing = (error.name or "").split(".")[0]
            (not_carried if missing in NOT_CARRIED else failed)[name] = f"{type(error).__name__}: {error}"
        except Exception as error:  # any failure at import is what this reports
            failed[name] = "".join(traceback.format_exception_only(error)).strip()
    summary = f"{len(names) - len(not_carried) - len(failed)} of {len(names)} modules import"
    if not_carried:
        summary += f"; {len(not_carried)} need {'/'.join(NOT_CARRIED)}, not carried: {', '.join(not_carried)}"
    if failed:
        summary += "; FAILED: " + "; ".join(f"{n}: {e}" for n, e in failed.items())
    return Outcome(summary, {"modules": len(names), "not_carried": not_carried, "failed": failed}, not failed)


def private_torch_api() -> Outcome:
    """The private names `lmgeo.study_b.muon` takes from `torch.optim._muon`, and its Muon against
    torch.optim.Muon on this device, with the arguments `lmgeo.study_b.optim` passes."""
    import torch
    from torch.optim._muon import _adjust_lr

    from lmgeo.study_b.muon import Muon, newton_schulz

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    signature = str(inspect.signature(_adjust_lr))
    ortho = newton_schulz(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)).to(device))
    singular = torch.linalg.svdvals(ortho.float()).cpu()
    start = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).to(device)
    grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(2)).to(device)
    stepped = []
    for optimizer in (Muon, torch.optim.Muon):
        param = torch.nn.Parameter(start.clone())
        param.grad = grad.clone()
        optimizer([param], lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True).step()
        stepped.append(param.detach() - start)
    gap = float((stepped[0] - stepped[1]).norm() / stepped[1].norm())
    held = bool(singular.max() < 1.5 and singular.min() > 0.3 and gap < 2e-2)  # NS: singular values near 1
    return Outcome(
        f"torch.optim._muon._adjust_lr{signature}; newton_schulz's singular values "
        f"{singular.min():.2f}–{singular.max():.2f}; Muon's step within {gap:.1e} of torch.optim.Muon's on {device}",
        {"signature": signature, "singular_values": singular.tolist(), "step_gap": gap},
        held,
    )
