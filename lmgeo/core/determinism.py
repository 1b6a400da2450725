"""What decides a process's floating-point kernels, pinned so that a result does not depend on the machine
that computed it (SPEC §1, "Reproducibility").

On x86-64, torch, MKL, oneDNN, OpenBLAS (NumPy, SciPy) and FAISS each pick their kernels by the CPU's
instruction set at run time, and a kernel for AVX-512 sums in another order than one for AVX2: the same
code and params then train different models on two machines (measured: the default study's `muon` test
losses move in the fourth digit between torch's AVX2 and AVX-512 kernels on one machine). Every lmgeo
process and Ray task runs with the AVX2 kernels of each library (every x86-64 server CPU since 2013 has
AVX2) and with its task's thread count for every threading layer, so its results are the same bytes on
any such machine of the same vendor, whatever the outer environment says. One switch is not vendor-neutral:
MKL honours its AVX2 reproducibility mode on Intel CPUs only (on AMD it reports `CNR:AUTO`; only the ~5×
slower `COMPATIBLE` mode would hold there), so torch's float32 GEMMs may differ in the last bits between an
Intel and an AMD machine. Other architectures (aarch64) have other kernels: there results agree within
SPEC's stated tolerance, not bit for bit; so do GPUs. The report's provenance records the kernels that ran.
"""

from __future__ import annotations

import os
import platform

# Each library's own switch for its AVX2 code path on every x86-64 CPU that has one.
X86_KERNELS = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's vectorised ATen kernels
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility (torch's BLAS and LAPACK)
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (torch's mkldnn kernels)
    "OPENBLAS_CORETYPE": "Haswell",  # NumPy's and SciPy's OpenBLAS
    "FAISS_SIMD_LEVEL": "AVX2",  # the kNN's float32 candidate pass (faiss ≥ 1.12 dispatches at run time)
}
# cuBLAS: deterministic reductions (torch.use_deterministic_algorithms asks for this workspace).
CUDA = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def pinned_environment(threads: int) -> dict[str, str]:
    """The environment variables a process computing with `threads` threads runs under."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    kernels = X86_KERNELS if platform.machine().lower() in ("x86_64", "amd64") else {}
    return {**kernels, **CUDA, **dict.fromkeys(THREAD_VARIABLES, str(threads))}


def pin_this_process(threads: int) -> None:
    """Pin the kernels of the running process. Effective only before torch, NumPy or FAISS are imported
    (each reads its switch once, when it loads): the CLI calls this first thing."""
    os.environ.update(pinned_environment(threads))


def pin_torch(threads: int) -> None:
    """The settings torch takes at run time: its thread count, and deterministic algorithms (a warning,
    not an error, where an op has no deterministic implementation)."""
    import torch

    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Deterministic mode also fills every new empty tensor with NaN; correct code never reads those values.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]  # a module property, absent from the stubs
