"""Mamba's kernel selection (`lmgeo.models.kernels`), on the CPU: with stand-in `mamba_ssm` and
`causal_conv1d` packages on the path, transformers picks them as it would pick the real ones, and our
routing keeps every CPU call on the PyTorch reference (the same numbers as without them), while a CUDA
argument reaches the kernel unless `use_mamba_kernels(False)` says otherwise. The real kernels run on a CUDA
machine only (`make gpu-check`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmgeo.models import kernels

# Stand-ins with the kernels' import paths and names; each returns its own name, so a call that reaches one
# is seen (a CPU model that reached one would fail at once).
FAKE_PACKAGES = {
    "mamba_ssm/__init__.py": "",
    "mamba_ssm/ops/__init__.py": "",
    "mamba_ssm/ops/selective_scan_interface.py": """
        def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                           out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, delta_softplus=True):
            return "kernel mamba_inner_fn"

        def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              return_last_state=False):
            return "kernel selective_scan_fn"
        """,
    "mamba_ssm/ops/triton/__init__.py": "",
    "mamba_ssm/ops/triton/selective_state_update.py": """
        def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
            return "kernel selective_state_update"
        """,
    "causal_conv1d/__init__.py": """
        def causal_conv1d_fn(x, weight, bias=None, activation=None):
            return "kernel causal_conv1d_fn"

        def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
            return "kernel causal_conv1d_update"
        """,
}

# In a fresh interpreter (transformers chooses when its Mamba module is first imported): what it chose, and
# a CPU training step of a tiny Mamba, its loss and gradient norm, and one routed call per device.
PROBE = """
import json, types, torch
from lmgeo.models import kernels
from lmgeo.models.config import ModelSize
from lmgeo.models.registry import build_model
model = build_model("mamba", ModelSize(d_model=16, n_layers=2, d_state=4, expand=2), 32, 12, seed=0)
ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
grad = sum(float(p.grad.double().norm() ** 2) for p in model.parameters() if p.grad is not None)
model.eval()
with torch.no_grad():
    logits = model(input_ids=ids).logits
found = {"packages": kernels.kernel_packages(), "implementations": kernels.implementations(),
         "loss": repr(loss.item()), "grad_sq": repr(grad), "eval_logits_sum": repr(float(logits.double().sum()))}
if any(found["packages"].values()):
    import transformers.models.mamba.modeling_mamba as mm
    cuda = types.SimpleNamespace(is_cuda=True)
    found["cuda_call"] = mm.causal_conv1d_fn(cuda, None, None, activation="silu")
    with kernels.use_mamba_kernels(False):
        try:
            mm.causal_conv1d_fn(cuda, None, None, activation="silu")
            found["cuda_call_without_kernels"] = "kernel"
        except AttributeError:  # the reference reads the stand-in's shape: it was called
            found["cuda_call_without_kernels"] = "reference"
print(json.dumps(found))
"""


def probe(extra_path: Path | None) -> dict:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fake_kernels(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kernels")
    for name, text in FAKE_PACKAGES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


@pytest.mark.slow  # two fresh interpreters
def test_with_kernels_installed_cpu_models_stay_on_the_reference_and_cuda_calls_reach_the_kernels(fake_kernels):
    without, with_kernels = probe(None), probe(fake_kernels)
    assert without["packages"] == {"mamba_ssm": False, "causal_conv1d": False}
    assert all(path.startswith("transformers.") for path in without["implementations"].values())
    assert with_kernels["packages"] == {"mamba_ssm": True, "causal_conv1d": True}
    chosen = with_kernels["implementations"]
    assert chosen == {
        "mamba_inner_fn": "mamba_ssm.ops.selective_scan_interface.mamba_inner_fn",
        "causal_conv1d_fn": "causal_conv1d.causal_conv1d_fn",
        "causal_conv1d_update": "causal_conv1d.causal_conv1d_update",
        "mamba_selective_scan": "mamba_ssm.ops.selective_scan_interface.selective_scan_fn",
        "mamba_selective_state_update": "mamba_ssm.ops.triton.selective_state_update.selective_state_update",
    }
    # the CPU training step and evaluation are the reference's, bit for bit
    for key in ("loss", "grad_sq", "eval_logits_sum"):
        assert with_kernels[key] == without[key]
    assert with_kernels["cuda_call"] == "kernel causal_conv1d_fn"
    assert with_kernels["cuda_call_without_kernels"] == "reference"


def test_routing_sends_cuda_to_the_chosen_function_and_the_rest_to_its_reference():
    def reference(x, *rest, **options):
        return "reference"

    def chosen(x, *rest, **options):
        return "kernel"

    chosen.__wrapped__ = reference
    routed = kernels.by_device(chosen)
    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    assert (routed(cuda, 1, k=2), routed(cpu, 1, k=2)) == ("kernel", "reference")
    with kernels.use_mamba_kernels(False):
        assert routed(cuda) == "reference"
    assert routed(cuda) == "kernel"


def test_without_kernel_packages_routing_touches_nothing(monkeypatch):
    monkeypatch.setattr(kernels, "kernel_packages", lambda: {"mamba_ssm": False, "causal_conv1d": False})
    imported = []
    monkeypatch.setattr(kernels.importlib, "import_module", lambda name: imported.append(name))
    kernels.route_mamba_kernels()
    assert imported == []
