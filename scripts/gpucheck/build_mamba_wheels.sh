#!/usr/bin/env bash
# Build mamba-ssm's and causal-conv1d's wheels on the CUDA machine, offline, in one device call of at most
# 10 minutes (the recipe and its measurements: scripts/gpucheck/mamba_wheels.py). Run from the repository root
# with the sdists carried (`make mamba-sdists` here first; the device call names .sdist in `carry`):
#
#     bash scripts/gpucheck/build_mamba_wheels.sh              # wheels, logs, SHA256SUMS, BUILD.json in $OUT
#     bash scripts/gpucheck/build_mamba_wheels.sh --dry-run    # prepare the sources, print the commands
#
# Then, here: python -m scripts.gpucheck.mamba_wheels adopt <the folder the files came back to>
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
exec "${GPU_PYTHON:-python3}" -m scripts.gpucheck.mamba_wheels build --sdists .sdist "$@"
