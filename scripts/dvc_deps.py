"""Writes each stage's code deps into `dvc.yaml` (`python -m scripts.dvc_deps --write`, keeping its data
deps, order and comments); without `--write` it prints them."""

from __future__ import annotations

import io
import sys
from pathlib import Path

from lmgeo.core.store import atomic_write
from lmgeo.driver.deps import STAGES, code_deps, is_code


def write(dvc_yaml: Path) -> None:
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096
    document = yaml.load(dvc_yaml.read_text())
    for stage in STAGES:
        deps = document["stages"][stage]["deps"]
        data = [d for d in deps if not is_code(str(d))]
        deps.clear()
        deps.extend(data + code_deps(stage, dvc_yaml.parent))
    text = io.StringIO()
    yaml.dump(document, text)
    atomic_write(dvc_yaml, text.getvalue())  # an interrupted rewrite must not leave dvc.yaml half-written


def main(argv: list[str]) -> None:
    workspace = Path.cwd()
    if argv == ["--write"]:
        write(workspace / "dvc.yaml")
        return
    for stage in STAGES:
        print(f"{stage}:\n" + "\n".join(f"  - {dep}" for dep in code_deps(stage, workspace)))


if __name__ == "__main__":
    main(sys.argv[1:])
