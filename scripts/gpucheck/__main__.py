"""`python -m scripts.gpucheck` (`make gpu-check`): install what the machine lacks from the carried
wheels, then run the plan and write `gpu.json` and `gpu.md` under `--out` (default `$OUT`, else
`build/gpu-check/`). Exit status 1 when a comparison failed or an item raised."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from scripts.gpucheck import mamba_wheels, wheels

# Items start only within this many seconds: a first run and a rerun of what it could not finish must both
# fit one session's 15 minutes of device time, machine start-ups included.
DEFAULT_BUDGET_S = 300.0


def cuda_missing() -> str | None:
    """Why this machine cannot run the check, or None. Asked of a child process: torch must not be
    imported here before the carried wheels are on the path (a newer typing-extensions must win)."""
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    if done.returncode == 3:
        return "torch.cuda.is_available() is False"
    return "torch does not import: " + (done.stderr.strip().splitlines() or ["?"])[-1]


def checked_commit() -> str:
    """The commit the check runs: git's, or `LMGEO_COMMIT` where the tree came without its .git (the device
    machine gets a copy of the working tree); `docs/scale.md` cites it with the figures."""
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=wheels.REPO, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else os.environ.get("LMGEO_COMMIT", "unknown")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpucheck", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the stand-in run, both sides on the CPU at tiny sizes (proves the code path only)",
    )
    parser.add_argument("--wheels", type=Path, default=wheels.WHEEL_DIR, help="carried wheels (make gpu-wheels)")
    parser.add_argument(
        "--kernel-wheels",
        type=Path,
        default=mamba_wheels.WHEELHOUSE,
        help="mamba-ssm's and causal-conv1d's wheels, built for this machine (build_mamba_wheels.sh)",
    )
    parser.add_argument("--site", type=Path, default=Path("/tmp/lmgeo-site"), help="where missing wheels are installed")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or wheels.REPO / "build" / "gpu-check"))
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="items past it are skipped")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="run only items whose 'section / name' contains TEXT (repeatable), e.g. to rerun what "
        "a first run skipped: --only compile --only measurements",
    )
    args = parser.parse_args(argv)

    if args.device == "cuda":
        reason = cuda_missing()
        if reason:
            print(f"no CUDA: skipped ({reason})")
            return 0
    install = wheels.install_missing(args.wheels, args.site)
    print(f"gpu-check: installed {', '.join(install['installed']) or 'nothing'} from {args.wheels}", flush=True)
    for unmet in install["unmet_requirements"]:
        print(f"gpu-check: unmet: {unmet}", flush=True)
    install["kernel_wheels"] = kernels = mamba_wheels.install_kernels(args.kernel_wheels, args.site)
    print(f"gpu-check: kernel wheels: {', '.join(kernels['installed']) or 'none'} ({kernels['reason']})", flush=True)
    return run(args, install)


def run(args: argparse.Namespace, install: dict) -> int:
    import torch  # only now: the carried wheels are on the path
    from transformers.utils import logging as transformers_logging

    from lmgeo.core.provenance import machine
    from scripts.gpucheck import compat, plan, summary

    # The device returns only the last 12,000 characters of output: keep them for the check's own lines
    # (everything it finds is in gpu.json and gpu.md anyway).
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    header = {
        "mode": "CUDA" if cuda else "CPU stand-in (no GPU figures)",
        "command": " ".join(["python -m scripts.gpucheck", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(device) if cuda else "the CPU",
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": checked_commit(),
        "budget_s": args.budget_s,
        "machine": machine(),
        "versions": compat.versions(),
        "device_facts": compat.device_facts(),
        "install": install,
        "note": None
        if cuda
        else (
            "Stand-in run: both sides of every comparison ran on the CPU and every figure is a CPU figure. "
            "It shows that the check runs end to end; it says nothing about a GPU."
        ),
    }
    started = time.perf_counter()

    def report(results: list, finished: bool = False) -> None:
        summary.write(args.out, header | {"wall_s": time.perf_counter() - started, "finished": finished}, results)

    sizes = plan.full_sizes() if cuda else plan.standin_sizes()
    chosen = [
        item
        for item in plan.items(sizes, device)
        if not args.only or any(text.lower() in f"{item.section} / {item.name}".lower() for text in args.only)
    ]
    results = plan.run(chosen, device, args.budget_s, report)
    report(results, finished=True)
    tally = summary.counts(results)
    print(
        f"gpu-check: {tally} in {time.perf_counter() - started:.0f} s; "
        f"{args.out / summary.MARKDOWN_NAME} and {summary.JSON_NAME}"
    )
    return 1 if tally["FAIL"] or tally["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
