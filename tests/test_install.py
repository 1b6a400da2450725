"""`make install` pulls torch's CPU build on a CPU machine: constraints.txt pins `+cpu` on Linux x86-64 (PyPI's
plain build there bundles CUDA), the Makefile installs torch first and falls back to the PyTorch CPU index only
after pip's own sources fail, and the full install keeps the build it found."""

from __future__ import annotations

import platform
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
LINUX_X86 = {"sys_platform": "linux", "platform_machine": "x86_64"}


def torch_pins(environment: dict[str, str]) -> list[str]:
    pins = [
        Requirement(line.split("#")[0])
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line.startswith("torch=")
    ]
    return [str(pin.specifier) for pin in pins if pin.marker is None or pin.marker.evaluate(environment)]


def test_constraints_pin_the_cpu_build_on_linux_x86_64_and_the_plain_one_elsewhere() -> None:
    assert torch_pins(LINUX_X86) == ["==2.13.0+cpu"]
    for system, machine in (("darwin", "arm64"), ("darwin", "x86_64"), ("linux", "aarch64"), ("win32", "AMD64")):
        assert torch_pins({"sys_platform": system, "platform_machine": machine}) == ["==2.13.0"], (system, machine)


def test_the_makefile_installs_torch_first_and_asks_the_cpu_index_only_when_pips_sources_fail() -> None:
    recipe = (REPO / "Makefile").read_text().split("$(VENV)/.installed:")[1].split("\n\n")[0]
    steps = [line.strip() for line in recipe.splitlines()[1:]]
    first_try, fallback = steps[1].split(" || ")
    assert first_try.endswith("-c constraints.txt torch 2>/dev/null") and "index" not in first_try
    assert fallback.endswith("-c constraints.txt --extra-index-url $(TORCH_CPU_INDEX) torch")
    assert steps[2].endswith("-c constraints.txt -e '.[dev]'")  # the package after torch, with the same pins
    assert "TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu" in (REPO / "Makefile").read_text()


def test_the_installed_torch_is_the_build_the_constraints_pin() -> None:
    """What `make install` left in this environment: pip's resolver kept the `+cpu` build on Linux x86-64."""
    here = {"sys_platform": sys.platform, "platform_machine": platform.machine()}
    (pin,) = torch_pins(here)
    assert metadata.version("torch") == pin.removeprefix("==")


@pytest.mark.slow  # builds the wheel in a subprocess
def test_the_wheel_installs_one_top_level_package_lmgeo(tmp_path: Path) -> None:
    """The wheel holds `lmgeo` and its metadata only: no generic top-level names (`tools`, `scripts`, ...)
    that would collide with a user's other packages, and the packaged default study is inside it."""
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("lmgeo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"lmgeo", "lmgeo-0.1.0.dist-info"}
    assert "lmgeo/default_study.yaml" in names and "lmgeo/cli.py" in names
