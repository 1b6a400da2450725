"""The wheels the CUDA machine lacks for the library path the GPU check runs: which, fetching them here,
and installing there only what is missing.

The CUDA machine has no network: a package reaches it only as a wheel inside the working tree, and the
tree that travels (the repo and the wheels) must stay under 64 MiB, which rules out Ray (a 79 MB wheel) and
DVC. The list is computed, not written down: lmgeo's own dependencies that the check's library path imports
when it runs (`imported_distributions`), and their requirements, less what the machine's image already has
(`machine_packages.txt`), each at its `constraints.txt` version, built for the machine's CPython 3.12 on
x86-64 Linux. A requirement that the machine has, but that a carried wheel constrains (pydantic needs a
recent typing-extensions), is carried too; the machine installs it only if its own version falls short.

    python -m scripts.gpucheck.wheels list       # what would be carried, and why
    python -m scripts.gpucheck.wheels download   # `make gpu-wheels`: fetch them into .whl/

Installing (`install_missing`) uses the standard library and `packaging` only: it runs on the machine
before anything else is importable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
WHEEL_DIR = REPO / ".whl"
TRAVEL_LIMIT_BYTES = 64 * 2**20  # what may travel to the device machine: repo + carried wheels
MACHINE_PACKAGES = Path(__file__).with_name("machine_packages.txt")

# The machine's interpreter and platform, for `pip download` and for evaluating requirement markers.
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
TARGET_MARKERS = {
    "python_version": TARGET_PYTHON,
    "python_full_version": f"{TARGET_PYTHON}.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}

# Imported for the wheel list: what the check runs, then a training step of every family, since some
# imports happen only inside a forward (transformers imports mambapy in Mamba's scan).
_EXERCISE = """
import json, sys
import scripts.gpucheck.plan
import torch
from lmgeo.models.config import ModelSize
from lmgeo.models.registry import FAMILIES, build_model
for family in FAMILIES:
    if family.trainable:
        model = build_model(family.name, ModelSize(d_model=16, n_layers=1, n_heads=2, d_state=4), 32, 8, seed=0)
        ids = torch.zeros((1, 8), dtype=torch.long)
        model(input_ids=ids, labels=ids).loss.backward()
print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))
"""


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them: `Typing_Extensions` is `typing-extensions`."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Carried:
    """One wheel to carry: `name==version`, and why (imported, or required by another carried wheel)."""

    name: str
    version: str
    reason: str

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


# ------------------------------------------------------------------------------ the list (here)
def machine_packages(path: Path = MACHINE_PACKAGES) -> frozenset[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return frozenset(canonical(line) for line in lines if line and not line.startswith("#"))


def read_pins(constraints: Path = REPO / "constraints.txt") -> dict[str, str]:
    """name → pinned version, of the pins whose markers hold on the machine (torch's build is per platform)."""
    pins = {}
    for line in constraints.read_text().splitlines():
        if line.split("#")[0].strip():
            pin = Requirement(line.split("#")[0])
            (spec,) = pin.specifier
            if pin.marker is None or pin.marker.evaluate(TARGET_MARKERS):
                pins[canonical(pin.name)] = spec.version
    return pins


def imported_distributions() -> set[str]:
    """Distributions whose modules the check's library path imports, found by running it in a fresh
    interpreter and mapping `sys.modules` to the distributions that provide them."""
    done = subprocess.run([sys.executable, "-c", _EXERCISE], cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"could not exercise the library path:\n{done.stderr[-3000:]}")
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    providers = metadata.packages_distributions()
    return {canonical(dist) for module in modules for dist in providers.get(module, [])} - {"lmgeo"}


def installed_requirements(dist: str) -> list[Requirement]:
    """`dist`'s requirements (as installed here) that apply on the machine: markers evaluated for it."""
    requirements = [Requirement(line) for line in metadata.requires(dist) or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(TARGET_MARKERS)]


def wheel_list(
    roots: Iterable[str],
    requirements: Callable[[str], list[Requirement]],
    on_machine: frozenset[str],
    pins: dict[str, str],
) -> list[Carried]:
    """The wheels to carry: the `roots` the machine lacks and, transitively, their requirements it lacks;
    plus each requirement it has that a carried wheel constrains by version (installed there only when
    the machine's own version does not satisfy it). Versions come from `pins`."""
    reasons: dict[str, str] = {}
    pending = sorted(canonical(r) for r in roots if canonical(r) not in on_machine)
    for name in pending:
        reasons[name] = "imported by the library path (an lmgeo dependency)"
    while pending:
        name = pending.pop(0)
        for requirement in requirements(name):
            dep = canonical(requirement.name)
            if dep in reasons:
                continue
            if dep not in on_machine:
                reasons[dep] = f"required by {name}"
                pending.append(dep)
            elif requirement.specifier:
                reasons[dep] = f"{name} needs {dep}{requirement.specifier}; installed only if the machine's is older"
    unpinned = sorted(set(reasons) - set(pins))
    if unpinned:
        raise ValueError(f"no version in constraints.txt for {', '.join(unpinned)}: pin them there")
    return [Carried(name, pins[name], reasons[name]) for name in sorted(reasons)]


def carried_list() -> list[Carried]:
    """lmgeo's own dependencies that its library path imports (what they import in turn is their own
    business: the machine's copies come with their own dependencies), closed over their requirements."""
    direct = {canonical(r.name) for r in project_requirements()}
    return wheel_list(imported_distributions() & direct, installed_requirements, machine_packages(), read_pins())


def download(carried: list[Carried], dest: Path) -> list[Path]:
    """Fetch exactly `carried` into `dest`, built for the machine, removing any other wheel there (two
    versions of one package would stop the whole install)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        platforms = [arg for platform in TARGET_PLATFORMS for arg in ("--platform", platform)]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                TARGET_PYTHON,
                "--implementation",
                "cp",
                *platforms,
                "-d",
                tmp,
                *(c.pin for c in carried),
            ],
            check=True,
        )
        fetched = sorted(Path(tmp).glob("*.whl"))
        for old in dest.glob("*.whl"):
            old.unlink()
        for wheel in fetched:
            wheel.rename(dest / wheel.name)
    return sorted(dest.glob("*.whl"))


def travelling_bytes(repo: Path = REPO, carried: Path | None = WHEEL_DIR) -> int:
    """Bytes that travel to the device machine: tracked and untracked-not-ignored files, plus the
    carried folder (ignored by git, named in the call's `carry`)."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=repo,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    files = [repo / name for name in listed if name and (repo / name).is_file()]
    if carried is not None and carried.is_dir():
        files += [path for path in carried.rglob("*") if path.is_file()]
    return sum(path.stat().st_size for path in files)


# -------------------------------------------------------------------------- installing (there)
def wheel_name(wheel: Path) -> str:
    """The distribution a wheel file holds (its file name's first field)."""
    return canonical(wheel.name.split("-")[0])


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """A wheel's requirements that apply to this interpreter (markers evaluated here, no extras)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        fields = Parser().parsestr(archive.read(name).decode())
    requirements = [Requirement(line) for line in fields.get_all("Requires-Dist") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def project_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    """lmgeo's own dependency ranges (`[project].dependencies`)."""
    import tomllib

    return [Requirement(line) for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


@dataclass(frozen=True)
class InstallPlan:
    install: list[Path]  # wheels to install
    present: dict[str, str]  # carried distributions the machine already has at a usable version
    unmet: list[str]  # requirements that neither the machine nor a carried wheel satisfies


def plan_install(
    wheels: list[Path],
    roots: list[Requirement],
    installed: Callable[[str], str | None] = installed_version,
) -> InstallPlan:
    """Install a carried wheel when its distribution is missing here, or when lmgeo (`roots`) or a wheel
    being installed needs a version that the machine's copy is not; list what nothing satisfies."""
    by_name = {wheel_name(w): w for w in wheels}
    chosen: list[str] = []
    unmet: list[str] = []

    def need(requirer: str, requirement: Requirement) -> None:
        dep, have = canonical(requirement.name), installed(canonical(requirement.name))
        if dep in chosen or (have is not None and requirement.specifier.contains(have, prereleases=True)):
            return
        if dep in by_name:
            chosen.append(dep)
        else:
            unmet.append(f"{requirer} needs {dep}{requirement.specifier}; this machine has {have or 'none'}")

    for requirement in roots:
        need("lmgeo", requirement)
    chosen += [name for name in by_name if name not in chosen and installed(name) is None]
    for name in chosen:  # grows while it runs: a chosen wheel's requirements may choose others
        for requirement in wheel_requirements(by_name[name]):
            need(name, requirement)
    present = {name: v for name in by_name if name not in chosen and (v := installed(name)) is not None}
    return InstallPlan([by_name[n] for n in sorted(chosen)], present, unmet)


def pip_install(wheels: list[Path], target: Path) -> None:
    """Install `wheels` as they are (no index, no dependencies) into `target`, and put `target` first on
    this process's and its children's import path."""
    if not wheels:
        return
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(target),
            *map(str, wheels),
        ],
        check=True,
    )
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))


def install_missing(wheel_dir: Path, target: Path) -> dict[str, object]:
    """Install what `plan_install` chooses from `wheel_dir` into `target`, and put `target` first on this
    process's and its children's import path. Returns what was done, for the summary."""
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    plan = plan_install(wheels, project_requirements())
    pip_install(plan.install, target)
    return {
        "wheel_dir": str(wheel_dir),
        "wheels_found": [w.name for w in wheels],
        "installed": [w.name for w in plan.install],
        "target": str(target) if plan.install else None,
        "already_on_machine": plan.present,
        "unmet_requirements": plan.unmet,
    }


# ------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpucheck.wheels", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("list", "download"))
    parser.add_argument("--to", type=Path, default=WHEEL_DIR, help="folder for the wheels (default .whl/, git-ignored)")
    args = parser.parse_args(argv)
    carried = carried_list()
    for c in carried:
        print(f"{c.pin:32} {c.reason}")
    if args.command == "list":
        return 0
    wheels = download(carried, args.to)
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    total = travelling_bytes(carried=args.to)
    print(
        f"{len(wheels)} wheels, {wheel_bytes / 2**20:.1f} MiB in {args.to}; with the repo {total / 2**20:.1f} MiB "
        f"travel (limit {TRAVEL_LIMIT_BYTES / 2**20:.0f} MiB)"
    )
    if total > TRAVEL_LIMIT_BYTES:
        print("too much to travel to the device machine", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
