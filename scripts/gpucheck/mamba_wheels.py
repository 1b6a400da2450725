"""mamba-ssm's and causal-conv1d's CUDA kernels as wheels for the GPU machine: built there, offline, in one
device call, and carried to every later check beside it.

PyPI has only their sources, which compile CUDA extensions against the local torch with nvcc, and the CUDA
machine has no network. The recipe, as measured on that machine (H200, nvcc 13.0, torch 2.11.0+cu130,
CPython 3.12; issue #39):

- Both `setup.py` files hard-code nine GPU architectures (`TORCH_CUDA_ARCH_LIST` is ignored): unpatched,
  the wheels are ~330 MB and the build ~9× longer. The patch keeps `compute_90,sm_90` only (the H200's)
  and adds nvcc's `--compress-mode=size` (objects 3.1× smaller: then ≈ 12 MB + ≈ 8 MB of wheels).
- `MAMBA_FORCE_BUILD=TRUE` and `CAUSAL_CONV1D_FORCE_BUILD=TRUE`: otherwise `setup.py` tries to download a
  prebuilt wheel and fails offline.
- `causal_conv1d_bwd.cu` is one translation unit of 18 explicit template instantiations (≈ 27 min for
  sm_90 on one core): split into parts of 3 (each ≈ 2 min), compiled in parallel. The slowest
  selective-scan unit takes ≈ 451 s on one core, which sets the build's length.
- `pip wheel --no-build-isolation --no-deps` against the machine's own torch, `MAX_JOBS` per package,
  both packages at once (16 cores); installed later with `--no-deps` (mamba-ssm's declared requirements,
  tilelang and quack-kernels among them, serve models this project does not train).
- First, that the image has Python 3.12's headers (`Python.h`): without them nothing compiles.

    make mamba-sdists                            # here: the two sdists, checked, into .sdist/ (git-ignored)
    bash scripts/gpucheck/build_mamba_wheels.sh    # there, carrying .sdist: wheels, logs, BUILD.json under $OUT
    python -m scripts.gpucheck.mamba_wheels adopt DIR  # here: check what came back, keep it in wheelhouse/
    make gpu-check                               # there: installs them (--no-deps) when present

`build --dry-run` does everything but compile (the preflight is reported, not enforced): unpacking,
patching and splitting are real, and the commands are printed. Standard library and `packaging` only.

A session lent the H200 has 15 minutes of device time, machine start-ups included, so: here, `make
gpu-wheels mamba-sdists`; device call 1, `bash scripts/gpucheck/build_mamba_wheels.sh` with `.sdist` carried
and `timeout_s` 600 (≈ 9–10 min by the measured compile times); here, `adopt` the files that came back
(the wheelhouse then travels with the tree); device call 2 on the still-warm machine, `make gpu-check
GPU_CHECK_ARGS="--only Mamba --only 'training step' --budget-s 150"` with `.whl` carried. The full check is
a later session's first call.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SDIST_DIR = REPO / ".sdist"
WHEELHOUSE = Path(__file__).with_name("wheelhouse")  # committed: the wheels, SHA256SUMS, BUILD.json
BUILD_SCRIPT = Path(__file__).with_name("build_mamba_wheels.sh")
SUMS, MANIFEST = "SHA256SUMS", "BUILD.json"
# Within the device's 600 s per command, leaving time to write what came back.
DEFAULT_DEADLINE_S = 560.0
LOG_TAIL_BYTES = 2 * 2**20  # what comes back of each build log (the device returns 16 MiB per file at most)
TARGET_PYTHON = (3, 12)
ARCH_FLAGS = ("-gencode", "arch=compute_90,code=sm_90", "--compress-mode=size")


@dataclass(frozen=True)
class Sdist:
    name: str  # import and file name
    version: str
    sha256: str  # of the sdist PyPI serves
    force_build: str  # the variable that stops setup.py looking for a prebuilt wheel
    skip_cuda: str  # the variable that lets setup.py describe itself without CUDA (for `pip download`)
    max_jobs: int  # parallel compilations (ninja), of the machine's 16 cores
    split: str | None = None  # a translation unit to split into parts of `PER_PART` instantiations

    @property
    def filename(self) -> str:
        return f"{self.name}-{self.version}.tar.gz"


PER_PART = 3
SDISTS = (
    # 10 units: the scan's 9 .cu files (forward and backward per dtype) and its binding; the slowest ≈ 451 s.
    Sdist(
        "mamba_ssm",
        "2.3.2.post1",
        "104cc47e9101e5401a675fa2b784f2952b9b037f3b1dd83b5ac544394e95d028",
        "MAMBA_FORCE_BUILD",
        "MAMBA_SKIP_CUDA_BUILD",
        max_jobs=10,
    ),
    # 9 units once split: forward, update, binding and 6 backward parts of ≈ 2 min each.
    Sdist(
        "causal_conv1d",
        "1.7.0",
        "3202758494eaa7b597ce1c282dfa188889506bfcb92cad3c407d26736bfcd32b",
        "CAUSAL_CONV1D_FORCE_BUILD",
        "CAUSAL_CONV1D_SKIP_CUDA_BUILD",
        max_jobs=6,
        split="csrc/causal_conv1d_bwd.cu",
    ),
)


class RecipeError(RuntimeError):
    """The sources are not the ones the recipe was written for, or the machine cannot build them."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------- here: sdists
def download(dest: Path = SDIST_DIR) -> list[Path]:
    """Fetch the two sdists from PyPI into `dest` and check them against their recorded sha256. pip prepares
    each one's metadata by running its setup.py, which imports torch: without build isolation (this
    environment's torch) and with its CUDA build skipped, so no GPU toolchain is needed here."""
    dest.mkdir(parents=True, exist_ok=True)
    env = os.environ | {s.skip_cuda: "TRUE" for s in SDISTS}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-binary",
            ":all:",
            "-d",
            str(dest),
            *(f"{s.name}=={s.version}" for s in SDISTS),
        ],
        env=env,
        check=True,
    )
    return [checked_sdist(dest, s) for s in SDISTS]


def checked_sdist(folder: Path, sdist: Sdist) -> Path:
    path = folder / sdist.filename
    if not path.is_file():
        raise RecipeError(
            f"{path} is missing: run `make mamba-sdists` where PyPI is reachable, and carry "
            f"{folder.name} to the CUDA machine"
        )
    if sha256(path) != sdist.sha256:
        raise RecipeError(f"{path}: sha256 {sha256(path)} is not the recorded {sdist.sha256}")
    return path


# -------------------------------------------------------------------------- the recipe's source edits
_ARCH_BLOCK = re.compile(
    r'^(?P<indent>[ \t]*)cc_flag\.append\("-gencode"\)\n.*?cc_flag\.append\("arch=compute_121,code=sm_121"\)\n',
    re.DOTALL | re.MULTILINE,
)


def patch_setup(text: str, source_parts: dict[str, list[str]] | None = None) -> str:
    """setup.py with its nine `-gencode` architectures replaced by `ARCH_FLAGS` (sm_90 only, compressed),
    and each source in `source_parts` replaced by its parts in the extension's source list. Raises where
    the text is not the one the recipe was written for."""
    blocks = _ARCH_BLOCK.findall(text)
    if len(blocks) != 1:
        raise RecipeError(f"setup.py: expected one architecture block ending in compute_121, found {len(blocks)}")
    patched = _ARCH_BLOCK.sub(
        lambda m: f"{m['indent']}cc_flag += {list(ARCH_FLAGS)!r}  # lmgeo: the H200's sm_90 only, compressed\n",
        text,
    )
    if re.findall(r"compute_\d+", patched) != ["compute_90"]:
        raise RecipeError("setup.py: architectures other than compute_90 remain after the patch")
    for source, parts in (source_parts or {}).items():
        listed = f'"{source}",'
        if patched.count(listed) != 1:
            raise RecipeError(f"setup.py: {source} is not listed exactly once among the sources")
        patched = patched.replace(listed, " ".join(f'"{p}",' for p in parts))
    compile(patched, "setup.py", "exec")  # still Python
    return patched


_INSTANTIATION = re.compile(r"^template void \w+<[^;]*>\([^;]*\);$")


def split_instantiations(text: str, per_part: int = PER_PART) -> list[str]:
    """A translation unit whose explicit template instantiations all come last, as parts of `per_part`
    instantiations each: every part holds the whole unit before them (templates only, so nothing is defined
    twice across parts) and its own instantiations."""
    lines = text.splitlines(keepends=True)
    first = next((i for i, line in enumerate(lines) if _INSTANTIATION.match(line.strip())), None)
    if first is None:
        raise RecipeError("no explicit template instantiations to split")
    tail = [line for line in lines[first:] if line.strip()]
    if not all(_INSTANTIATION.match(line.strip()) for line in tail):
        raise RecipeError("the instantiations are not all at the end of the unit")
    head = "".join(lines[:first])
    return [head + "".join(tail[i : i + per_part]) for i in range(0, len(tail), per_part)]


def prepare(sdist_dir: Path, work: Path) -> dict[str, Path]:
    """Each sdist unpacked into `work`, checked, its setup.py patched and its slow unit split; returns the
    source tree of each package."""
    trees = {}
    for sdist in SDISTS:
        with tarfile.open(checked_sdist(sdist_dir, sdist)) as archive:
            archive.extractall(work, filter="data")
        tree = work / f"{sdist.name}-{sdist.version}"
        parts: dict[str, list[str]] = {}
        if sdist.split is not None:
            unit = tree / sdist.split
            pieces = split_instantiations(unit.read_text())
            names = [f"{Path(sdist.split).with_suffix('')}_part{i}.cu" for i in range(len(pieces))]
            for name, piece in zip(names, pieces, strict=True):
                (tree / name).write_text(piece)
            unit.unlink()
            parts[sdist.split] = names
        setup = tree / "setup.py"
        setup.write_text(patch_setup(setup.read_text(), parts))
        trees[sdist.name] = tree
    return trees


# ------------------------------------------------------------------------------- there: the build
def preflight() -> dict[str, object]:
    """What the build needs of the machine, and what it lacks (`problems`)."""
    problems = []
    include = Path(sysconfig.get_config_var("INCLUDEPY") or sysconfig.get_paths()["include"])
    if sys.version_info[:2] != TARGET_PYTHON:
        problems.append(f"python is {sys.version.split()[0]}, the recipe is for {'.'.join(map(str, TARGET_PYTHON))}")
    if not (include / "Python.h").is_file():
        problems.append(f"no Python.h in {include}: the image lacks Python's headers, nothing can compile")
    nvcc = shutil.which("nvcc") or next((str(p) for p in [Path("/usr/local/cuda/bin/nvcc")] if p.exists()), None)
    nvcc_version = None
    if nvcc is None:
        problems.append("no nvcc on PATH or in /usr/local/cuda/bin")
    else:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
        nvcc_version = (done.stdout.strip().splitlines() or ["?"])[-1]
    facts = {
        "python": sys.version.split()[0],
        "python_include": str(include),
        "nvcc": nvcc,
        "nvcc_version": nvcc_version,
        "ninja": shutil.which("ninja"),
        "cpus": os.cpu_count(),
    }
    try:
        import torch

        facts |= {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
        if torch.version.cuda is None:
            problems.append(f"torch {torch.__version__} is not a CUDA build")
    except ImportError as error:
        problems.append(f"torch does not import: {error}")
    if facts["ninja"] is None:
        problems.append("no ninja on PATH: torch's extension builder would compile one unit at a time")
    return facts | {"problems": problems}


def wheel_command(tree: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-build-isolation",
        "--no-deps",
        "--no-index",
        "-w",
        str(out),
        str(tree),
    ]


def wheel_env(sdist: Sdist) -> dict[str, str]:
    return {sdist.force_build: "TRUE", "MAX_JOBS": str(sdist.max_jobs)}


def build(sdist_dir: Path, out: Path, deadline_s: float = DEFAULT_DEADLINE_S, dry_run: bool = False) -> int:
    """Both wheels at once, into `out` with their logs, `SHA256SUMS` and `BUILD.json`; exit status 0 when
    both were built. Builds still running at the deadline are stopped (and say so)."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    facts = preflight()
    print(f"mamba-wheels: {json.dumps(facts)}", flush=True)
    if facts["problems"] and not dry_run:
        print("mamba-wheels: cannot build: " + "; ".join(facts["problems"]), file=sys.stderr)  # type: ignore[arg-type]
        return 2
    with tempfile.TemporaryDirectory(prefix="lmgeo-mamba-wheels-") as scratch:
        trees = prepare(sdist_dir, Path(scratch))
        wheel_dirs = {s.name: Path(scratch) / f"wheel-{s.name}" for s in SDISTS}
        for sdist in SDISTS:
            command = wheel_command(trees[sdist.name], wheel_dirs[sdist.name])
            print(f"mamba-wheels: {' '.join(f'{k}={v}' for k, v in wheel_env(sdist).items())} {' '.join(command)}")
        if dry_run:
            for name, tree in trees.items():
                print(f"mamba-wheels: prepared {name}: {sorted(p.name for p in tree.rglob('*.cu'))}")
            return 0
        results = run_builds(trees, wheel_dirs, out, started + deadline_s)
        for sdist in SDISTS:
            built = sorted(wheel_dirs[sdist.name].glob("*.whl"))
            if results[sdist.name]["status"] == "built" and len(built) == 1:
                shutil.copy2(built[0], out / built[0].name)
                results[sdist.name] |= {
                    "wheel": built[0].name,
                    "wheel_sha256": sha256(built[0]),
                    "wheel_bytes": built[0].stat().st_size,
                }
            elif results[sdist.name]["status"] == "built":
                results[sdist.name]["status"] = f"pip succeeded but left {len(built)} wheels"
    write_manifest(out, facts, results)
    for name, result in results.items():
        print(f"mamba-wheels: {name}: {result['status']} in {result['seconds']:.0f} s", flush=True)
    return 0 if all(r["status"] == "built" for r in results.values()) else 1


def run_builds(trees: dict[str, Path], wheel_dirs: dict[str, Path], out: Path, deadline: float) -> dict[str, dict]:
    """Start every package's `pip wheel` at once (each in its own process group), wait for them until
    `deadline` (time.monotonic), stop what is left; logs go to `out/build-<name>.log`, cut to their tail."""
    running = {}
    for sdist in SDISTS:
        log = (out / f"build-{sdist.name}.log").open("wb")
        process = subprocess.Popen(
            wheel_command(trees[sdist.name], wheel_dirs[sdist.name]),
            env=os.environ | wheel_env(sdist),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        running[sdist.name] = (process, log, time.monotonic())
    results = {}
    for name, (process, log, began) in running.items():
        try:
            code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
            status = "built" if code == 0 else f"pip wheel failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = "stopped at the deadline"
        log.close()
        keep_tail(out / f"build-{name}.log", LOG_TAIL_BYTES)
        results[name] = {
            "status": status,
            "seconds": time.monotonic() - began,
            "max_jobs": next(s.max_jobs for s in SDISTS if s.name == name),
        }
    return results


def keep_tail(path: Path, limit: int) -> None:
    data = path.read_bytes()
    if len(data) > limit:
        path.write_bytes(b"[... cut: the log's last %d bytes follow]\n" % limit + data[-limit:])


def write_manifest(out: Path, facts: dict, results: dict[str, dict]) -> None:
    """`BUILD.json` (what built the wheels, from which sources, on what) and `SHA256SUMS` (the wheels')."""
    sources = {p.relative_to(REPO).as_posix(): sha256(p) for p in (BUILD_SCRIPT, Path(__file__))}
    manifest = {
        "built_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "recipe": {"arch_flags": list(ARCH_FLAGS), "per_part": PER_PART, "scripts_sha256": sources},
        "machine": facts,
        "packages": {s.name: {"version": s.version, "sdist_sha256": s.sha256, **results[s.name]} for s in SDISTS},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    sums = [f"{r['wheel_sha256']}  {r['wheel']}\n" for r in results.values() if "wheel" in r]
    (out / SUMS).write_text("".join(sums))


# ----------------------------------------------------------------------------- here: keeping them
def verified_wheels(folder: Path) -> list[Path]:
    """The wheels `SHA256SUMS` lists in `folder`, each checked; raises on a mismatch or a missing one."""
    lines = [line.split() for line in (folder / SUMS).read_text().splitlines() if line.strip()]
    wheels = []
    for digest, name in lines:
        path = folder / name
        if not path.is_file() or sha256(path) != digest:
            raise RecipeError(f"{path}: missing, or not the wheel {SUMS} lists ({digest})")
        wheels.append(path)
    return sorted(wheels)


def adopt(source: Path, dest: Path = WHEELHOUSE) -> list[Path]:
    """Keep a build's wheels (checked against its `SHA256SUMS`) with its `SHA256SUMS` and `BUILD.json` in
    `dest`, replacing what was there."""
    wheels = verified_wheels(source)
    manifest = json.loads((source / MANIFEST).read_text())
    if {p.name.split("-")[0] for p in wheels} != {s.name for s in SDISTS}:
        raise RecipeError(f"{source}: expected a wheel of each of {[s.name for s in SDISTS]}, found {wheels}")
    dest.mkdir(parents=True, exist_ok=True)
    for old in [*dest.glob("*.whl"), dest / SUMS, dest / MANIFEST]:
        old.unlink(missing_ok=True)
    for path in [*wheels, source / SUMS, source / MANIFEST]:
        shutil.copy2(path, dest / path.name)
    print(f"kept {len(wheels)} wheels built with torch {manifest['machine'].get('torch')} in {dest}")
    return sorted(dest.glob("*.whl"))


# ------------------------------------------------------------------------------- there: installing
@dataclass(frozen=True)
class KernelInstall:
    wheels: list[Path]  # to install (empty: none)
    reason: str  # why these, or why none


def plan_kernel_install(folder: Path, torch_version: str | None) -> KernelInstall:
    """The wheelhouse's wheels, where there are any, they are the ones `SHA256SUMS` lists, and they were
    built against this machine's torch (a compiled extension loads against that exact build only)."""
    if not (folder / SUMS).is_file():
        return KernelInstall([], f"no kernel wheels in {folder} (scripts/gpucheck/build_mamba_wheels.sh builds them)")
    wheels = verified_wheels(folder)
    built_with = json.loads((folder / MANIFEST).read_text())["machine"].get("torch")
    if built_with != torch_version:
        return KernelInstall([], f"built against torch {built_with}, this machine has {torch_version}: rebuild them")
    return KernelInstall(wheels, f"built against this machine's torch {torch_version}")


def install_kernels(folder: Path, target: Path) -> dict[str, object]:
    """`make gpu-check`'s step: install the wheelhouse's kernel wheels into `target` (`--no-deps`) where
    `plan_kernel_install` allows; returns what was done and why, for the summary. torch's version is read
    from its metadata: torch must not be imported before everything carried is on the path."""
    from importlib import metadata

    from scripts.gpucheck.wheels import pip_install

    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    plan = plan_kernel_install(folder, torch_version)
    pip_install(plan.wheels, target)
    return {"installed": [w.name for w in plan.wheels], "reason": plan.reason}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpucheck.mamba_wheels", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("download", help="here: fetch and check the two sdists (make mamba-sdists)")
    get.add_argument("--to", type=Path, default=SDIST_DIR)
    make = commands.add_parser("build", help="there: build both wheels into --out (build_mamba_wheels.sh)")
    make.add_argument("--sdists", type=Path, default=SDIST_DIR)
    make.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "build" / "mamba-wheels"))
    make.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S)
    make.add_argument("--dry-run", action="store_true", help="prepare the sources and print the commands only")
    keep = commands.add_parser("adopt", help="here: keep a build's wheels in scripts/gpucheck/wheelhouse/")
    keep.add_argument("source", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "download":
            for path in download(args.to):
                print(f"{path} ({sha256(path)})")
            return 0
        if args.command == "build":
            return build(args.sdists, args.out, args.deadline_s, args.dry_run)
        adopt(args.source)
        return 0
    except RecipeError as error:
        print(f"mamba-wheels: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
