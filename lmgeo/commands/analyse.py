"""`lmgeo analyse MODEL [--out DIR]`: Study A on one causal LM, a local `save_pretrained` folder or a hub id,
without training, from any folder.

Its settings are the default study's (`lmgeo/default_study.yaml`, shipped with the package: never the
`params.yaml` of the folder it is started in), or another study's (`--params FILE`), with `--k`, `--anchors`,
`--classes` and `--layers` on top. The model is named by its folder's name (or its hub id) everywhere.

`DIR` (default `analyse-<name>` here) becomes a workspace of its own: a `params.yaml` that is those settings
with `analysis.external_models` the model and, by default, a copy of its architecture with random weights
(`<name>-random`, seeded by `analysis.seed`, saved in `DIR/models/`: the baseline a verdict is read against),
and `analysis.runs` null (nothing trained); then the eval text (held-out text in the model's own tokenizer),
`extract`, `fit`, `perturb` and `aggregate` (its tables, from the fits and KLs alone) run there, and
a report of Study A's parts (`report.md`, `report.html`, `figures/`) reads the model against its copy.
`lmgeo query` works in `DIR` as in any workspace.

Refusals come before any work and leave no folder behind: without importing torch (well under 2 s), a path
that is no folder, a folder without `config.json`, a config whose architectures are none a causal LM's, a
folder without tokenizer files, and an `--out` that holds anything but an earlier analysis (a study's
`params.yaml` or `dvc.yaml`, other files, a dangling symlink) or that another analysis is writing (a lock on
the folder); after loading the model, before any stage, a structure that fails verification or a width
`analysis.k` cannot identify. `DIR/.lmgeo-analyse.json` marks the folder as
analyse's and records the request it completed (settings, the model's files, the code): a rerun of the same
request returns at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lmgeo.core.config import ParamsError, load_yaml
from lmgeo.core.errors import InputError
from lmgeo.driver.layout import Layout
from lmgeo.params import DEFAULT_STUDY, Params, apply_overrides

STAGES = ("extract", "fit", "perturb")
MARKER = ".lmgeo-analyse.json"
LOCK = ".lmgeo-analyse.lock"
# Files one of which a saved tokenizer has (fast: tokenizer.json; sentencepiece: *.model; BPE: vocab.json;
# WordPiece: vocab.txt).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
# The class names of causal LMs in transformers end so (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, a test checks);
# a multimodal `...ForConditionalGeneration` is left to the full check, which reads the model type.
_CAUSAL_NAME = re.compile(r"(ForCausalLM|LMHeadModel|WithLMHead|Decoder|ForConditionalGeneration)$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
RANDOM_SUFFIX = "-random"
NAME_MAX = 255  # bytes in one file name (ext4, xfs, btrfs, APFS)


@dataclass(frozen=True)
class ModelSource:
    ref: str  # an absolute folder, or a hub id
    name: str  # how tables and the report name it: the folder's name, or the hub id
    revision: str | None = None

    @property
    def local(self) -> bool:
        return Path(self.ref).is_absolute()

    @property
    def folder_name(self) -> str:
        """Its name as one folder name (a hub id's `/` written `--`, as partition paths write it)."""
        return self.name.replace("/", "--")


# --------------------------------------------------------------------------- checks before any import
def locate_model(arg: str, revision: str | None = None) -> ModelSource:
    """The model `arg` names: a local folder (checked: config, a causal LM's, tokenizer files), or a hub id
    (`org/name`, when no such local path exists); `InputError` naming the problem otherwise."""
    path = Path(arg).expanduser()
    if path.is_dir():
        folder = path.resolve()
        _check_folder(folder, arg)
        if revision is not None:
            raise InputError(f"--revision {revision}: a hub revision, but {arg} is a local folder")
        return _fits(ModelSource(str(folder), folder.name), arg)
    if path.exists():
        raise InputError(f"{arg}: not a folder; give a model folder saved with `save_pretrained`, or a hub id")
    if _HUB_ID.match(arg) and not Path(arg.split("/")[0]).is_dir():
        return _fits(ModelSource(arg, arg, revision), arg)
    raise InputError(f"{arg}: no such folder (a hub id has the form `org/name`)")


def _fits(source: ModelSource, arg: str) -> ModelSource:
    """`source`, refused when the folders named after it (`analyse-<name>`, `<name>-random`) would be longer than
    a file name (an `OSError` half-way otherwise)."""
    longest = max(f"analyse-{source.folder_name}", f"{source.folder_name}{RANDOM_SUFFIX}", key=len)
    if len(longest.encode()) > NAME_MAX:
        shown = f"{arg[:60]}…" if len(arg) > 60 else arg
        raise InputError(
            f"{shown}: a model name of {len(source.name)} characters; the folders named after it ({longest[:40]}…) "
            f"would be longer than a file name ({NAME_MAX} bytes): give a shorter hub id (`org/name`), or rename "
            "the model folder"
        )
    return source


def _check_folder(folder: Path, arg: str) -> None:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise InputError(f"{arg}: no config.json: not a model folder saved with `save_pretrained`")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"{arg}/config.json: unreadable ({err})") from None
    architectures = config.get("architectures") or []
    if architectures and not any(_CAUSAL_NAME.search(str(a)) for a in architectures):
        raise InputError(
            f"{arg}: not a causal LM (config.json: {', '.join(map(str, architectures))}, model type "
            f"{config.get('model_type')!r}); Study A analyses decoder-only causal LMs (`...ForCausalLM`)"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(
            f"{arg}: no tokenizer files beside the model (none of {', '.join(TOKENIZER_FILES)}); save its tokenizer "
            f"there: `tokenizer.save_pretrained({str(arg)!r})`"
        )


def output_folder(out: Path | None, source: ModelSource) -> Path:
    """`--out` (default `analyse-<name>`), refused when it holds anything but an earlier analysis of this model."""
    out = out or Path(f"analyse-{source.folder_name}")
    if out.is_symlink() and not out.exists():
        raise InputError(f"--out {out}: a symlink to {os.readlink(out)}, which does not exist; name a real folder")
    if not out.exists():
        return out
    if not out.is_dir():
        raise InputError(f"--out {out}: a file, not a folder")
    # `dvc.yaml`, `.dvc` and `.git` are a study's or a repository's, never analyse's (a marker copied into one
    # does not make it an analysis); analyse writes a `params.yaml` of its own.
    study = [name for name in ("params.yaml", "dvc.yaml", ".dvc", ".git") if (out / name).exists()]
    marker = out / MARKER
    if marker.is_file() and not set(study) - {"params.yaml"}:
        analysed = _read_marker(out).get("model")
        if analysed != source.name:
            raise InputError(f"--out {out}: holds the analysis of {analysed}, not {source.name}; name another folder")
        return out
    if study:
        raise InputError(
            f"--out {out}: holds a study ({', '.join(study)}) that `lmgeo analyse` did not write; name a new folder"
        )
    if any(path.name != LOCK for path in out.iterdir()):
        raise InputError(f"--out {out}: not empty, and not a folder `lmgeo analyse` wrote; name a new or empty folder")
    return out


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """`out` held by this analysis alone (an exclusive lock on `out/.lmgeo-analyse.lock`, released when the process
    ends): a second analysis of the same folder is refused instead of writing its model into the first's."""
    with open(out / LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(
                f"--out {out}: another `lmgeo analyse` is writing this folder; wait for it to finish, or name another"
            ) from None
        yield


def overrides(
    k: int | None = None, anchors: int | None = None, classes: list[str] | None = None, layers: list[str] | None = None
) -> dict[str, str]:
    """The command line's settings as params overrides (`--classes a,b` or repeated; likewise `--layers`)."""
    listed_layers = _listed(layers)
    chosen: dict[str, Any] = {
        "analysis.k": k,
        "analysis.anchors": anchors,
        "analysis.classes": _listed(classes),
        "analysis.layers": [int(x) if x.isdigit() else x for x in listed_layers] if listed_layers else None,
    }
    return {
        key: json.dumps(value) if isinstance(value, list) else str(value)
        for key, value in chosen.items()
        if value is not None
    }


def _listed(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def base_params(path: Path | None) -> dict[str, Any]:
    """The settings the analysis starts from, as written: `path`, or the default study shipped with lmgeo."""
    raw = load_yaml(path or DEFAULT_STUDY)
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of params sections")
    return raw


def request_key(raw: dict[str, Any], settings: dict[str, str], source: ModelSource, baseline: bool) -> str:
    """What decides the analysis's results, cheaply: the settings as written, the model's files (by name, size
    and modification time, as DVC's own cache does) or hub revision, whether the copy is analysed, and the
    code of the packages that compute it."""
    if source.local:
        files = sorted(p for p in Path(source.ref).rglob("*") if p.is_file())
        model: Any = [[p.relative_to(source.ref).as_posix(), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    else:
        model = [source.ref, source.revision]
    code = hashlib.sha256()
    for package in ("lmgeo",):
        root = Path(importlib.import_module(package).__file__ or "").parent
        for path in sorted(root.rglob("*.py")):
            code.update(path.relative_to(root.parent).as_posix().encode() + b"\0" + path.read_bytes())
    record = {
        "params": raw,
        "settings": settings,
        "model": model,
        "name": source.name,
        "baseline": baseline,
        "code": code.hexdigest(),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]


def up_to_date(out: Path, key: str) -> Path | None:
    """The report of `out` when its analysis completed exactly this request (nothing to do), else None."""
    report = out / "report.md"
    return report if (out / MARKER).is_file() and _read_marker(out).get("done") == key and report.is_file() else None


def _read_marker(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return {}


def _write_marker(out: Path, source: ModelSource, done: str | None) -> None:
    from lmgeo.core.store import atomic_write

    record = {"written_by": "lmgeo analyse", "model": source.name, "ref": source.ref, "done": done}
    atomic_write(out / MARKER, json.dumps(record, indent=1) + "\n")


# ------------------------------------------------------------------------------------------ the run
def run(
    params: Params,
    ray_address: str | None = None,
    *,
    source: ModelSource,
    out: Path,
    baseline: bool = True,
    key: str | None = None,
) -> Path:
    """Run Study A on `source` in the workspace `out` (module docstring); returns the report's path."""
    from lmgeo.stages import aggregate

    started = time.monotonic()
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with exclusive(out):
        output_folder(out, source)  # again, under the lock: another analysis may have written it since the check
        _write_marker(out, source, None)
        layout = Layout(out.resolve())
        try:  # nothing of value exists before the first stage: a refusal leaves no folder behind
            study, eval_note = prepare_workspace(params, source, layout, baseline)
        except BaseException:
            if created:
                shutil.rmtree(layout.root, ignore_errors=True)
            raise
        steps = len(STAGES) + 2
        print(f"analyse: [1/{steps}] eval text: {eval_note}", flush=True)
        for number, stage in enumerate(STAGES, start=2):
            print(f"analyse: [{number}/{steps}] {stage}", flush=True)
            importlib.import_module(f"lmgeo.stages.{stage}").run(study, layout, ray_address)
        print(f"analyse: [{steps}/{steps}] tables and report", flush=True)
        aggregate.run(study, layout, ray_address, trained=False)
        report = write_report(layout, study, source, eval_note)
        _write_marker(out, source, key)
    print(f"analyse: wrote {out / report.name} in {time.monotonic() - started:.0f} s", flush=True)
    print(f"analyse: {one_model_caveat(baseline)}", flush=True)
    return out / report.name


def prepare_workspace(params: Params, source: ModelSource, layout: Layout, baseline: bool) -> tuple[Params, str]:
    """The study to run in `layout` (written to its `params.yaml`), after every check that can refuse the model,
    with its random-weight copy saved beside it (`baseline`) and the eval text prepared in the model's own
    tokenizer; and what the eval text is, in words."""
    from lmgeo.text.corpus import prepare

    model = one_model_study(params, source, layout, tokenizer=None, copy=None)
    check(model, layout)
    tokenizer = save_tokenizer(source, layout.root / "models" / "tokenizer")
    copy = (
        save_random_copy(source, layout.root / "models" / f"{source.folder_name}{RANDOM_SUFFIX}", params.analysis.seed)
        if baseline
        else None
    )
    study = one_model_study(params, source, layout, tokenizer, copy)
    (layout.root / "params.yaml").write_text(yaml.safe_dump(study.model_dump(mode="json"), sort_keys=False))
    summary = prepare(study.prepare, layout.tokens, layout.tokenizer, workspace=layout.root, allow_outside_paths=True)
    a = study.analysis
    words = "held-out text of the default corpus" if study.prepare.corpus.source == "shakespeare" else "held-out text"
    sequences = f"{a.eval_sequences} sequences of {study.prepare.seq_len}"
    if tokenizer is not None:
        return study, f"{sequences} tokens of {words}, in {source.name}'s tokenizer ({summary.vocab_size:,} tokens)"
    return study, (
        f"{words}, split into documents by a BPE trained on it ({source.name}'s tokenizer has no end-of-text token "
        f"to separate them), re-encoded with {source.name}'s tokenizer: {sequences} of its tokens"
    )


def one_model_study(
    params: Params, source: ModelSource, layout: Layout, tokenizer: Path | None, copy: Path | None
) -> Params:
    """`params` with the model (a folder relative to the workspace, so that no result holds a machine's absolute
    path; named by its folder's name) and its random-weight `copy` as the only models analysed, no trained run,
    and the eval text in the model's `tokenizer` (when it can separate documents). The folder named on the
    command line may lie outside the workspace (naming it is the consent `security.allow_outside_paths` asks
    for)."""
    ref = os.path.relpath(source.ref, layout.root) if source.local else source.ref
    models = [{"id": ref, "name": source.name, "revision": source.revision}]
    if copy is not None:
        models.append({"id": copy.relative_to(layout.root).as_posix(), "name": f"{source.name}{RANDOM_SUFFIX}"})
    changes = {
        "analysis.runs": "null",
        "analysis.external_models": json.dumps(models),
        "security.allow_outside_paths": "true",
    }
    if tokenizer is not None:
        local = {"kind": "local", "path": tokenizer.relative_to(layout.root).as_posix()}
        changes["prepare.tokenizer"] = json.dumps(local)
    return apply_overrides(params, changes)


def check(params: Params, layout: Layout) -> None:
    """Everything that would stop the analysis later, before the first stage: the model's structure and its
    tokenizer (`lmgeo.driver.opening.check_external_model`), and its width against `analysis.k` (which the fit
    stage would only find after the extraction)."""
    from lmgeo.driver.analysis_set import external_model
    from lmgeo.driver.opening import check_external_model
    from lmgeo.models.structure import text_config
    from lmgeo.stages.fit import check_identifiable

    ref = params.analysis.external_models[0]
    model = external_model(params, layout, ref.id, ref.revision, ref.name)
    net = check_external_model(params, layout, model)
    width = getattr(text_config(net), "hidden_size", None) if net is not None else None
    if isinstance(width, int):
        try:
            check_identifiable(params.analysis, model.table_id, width)
        except InputError as err:
            raise InputError(f"{err} (`lmgeo analyse --k`, `--classes`)") from None


def save_tokenizer(source: ModelSource, dest: Path) -> Path | None:
    """The model's tokenizer saved in `dest`, for the eval text; None when it has no end-of-text token (the
    text is then split by a BPE, and each model re-encodes it with its own tokenizer at extraction)."""
    from transformers import AutoTokenizer

    from lmgeo.core.store import atomic_path

    tokenizer = AutoTokenizer.from_pretrained(source.ref, revision=source.revision, trust_remote_code=False)
    if tokenizer.eos_token_id is None:
        return None
    with atomic_path(dest) as staged:
        tokenizer.save_pretrained(staged)
    return dest


def save_random_copy(source: ModelSource, dest: Path, seed: int) -> Path:
    """A copy of the model's architecture with random weights (its family's own initialisation, seeded), and its
    tokenizer, saved in `dest`; reused while the model's config and the seed are those it was made from."""
    from transformers import AutoConfig, AutoTokenizer

    from lmgeo.commands.verify.families import save_tiny_model
    from lmgeo.core.config import digest
    from lmgeo.core.store import atomic_path

    config = AutoConfig.from_pretrained(source.ref, revision=source.revision, trust_remote_code=False)
    made_from = digest({"config": config.to_dict(), "seed": seed})
    record = dest / "lmgeo-random.json"
    if record.is_file() and json.loads(record.read_text()).get("made_from") == made_from:
        return dest
    tokenizer = AutoTokenizer.from_pretrained(source.ref, revision=source.revision, trust_remote_code=False)
    with atomic_path(dest) as staged:
        save_tiny_model(config, staged, seed)
        tokenizer.save_pretrained(staged)
        (staged / record.name).write_text(json.dumps({"copy_of": source.name, "seed": seed, "made_from": made_from}))
    return dest


# ----------------------------------------------------------------------------------------- the report
def one_model_caveat(baseline: bool) -> str:
    against = " and its random-weight copy" if baseline else ""
    return (
        f"the verdicts rest on one model{against}: a claim's interval resamples that model's anchors, not models, so "
        "it says whether the claim holds for this model, not for models like it (the default study's verdicts "
        "resample five seeds per architecture)"
    )


def write_report(layout: Layout, study: Params, source: ModelSource, eval_note: str) -> Path:
    """`report.md` (and `report.html`, `figures/`) in the workspace: the model read against its random-weight
    copy, then Study A's summary and section of the study's report for the two models."""
    from lmgeo.core.contracts import RESULT_TABLES, external_table_id, read_result_tables
    from lmgeo.core.store import atomic_write
    from lmgeo.results.common import Figures
    from lmgeo.results.html import to_html
    from lmgeo.results.study_a import report as study_a
    from lmgeo.results.study_a.claims import summarise

    found = read_result_tables(layout.tables)
    tables = {name: found[name].to_pylist() if name in found else [] for name in RESULT_TABLES}
    figures_dir = layout.root / "figures"
    figures_dir.mkdir(exist_ok=True)
    claims = summarise(tables["claim_tests"])
    figures = Figures(figures_dir, Path("figures"))
    labels = [external_table_id(m.name or m.id) for m in study.analysis.external_models]
    text = "\n".join(
        [
            f"# lmgeo analyse: {source.name}\n",
            _setup(study, source, labels, eval_note),
            _against_random(claims, labels) if len(labels) > 1 else "",
            f"**One model.** {_sentence(one_model_caveat(len(labels) > 1))}\n",
            study_a.claims_summary(claims, tables["geometry"], tables["claim_tests"], figures, tables["paper_values"]),
            study_a.section(tables, claims, figures),
        ]
    )
    out = layout.root / "report.md"
    atomic_write(out, text)
    atomic_write(out.with_suffix(".html"), to_html(text, layout.root, title=f"lmgeo analyse: {source.name}"))
    return out


def _sentence(text: str) -> str:
    return f"{text[0].upper()}{text[1:]}."


def _setup(study: Params, source: ModelSource, labels: list[str], eval_note: str) -> str:
    a = study.analysis
    layers = "every layer" if a.layers is None else f"layers {', '.join(map(str, a.layers))}"
    copy = (
        f" beside `{labels[1]}`: the same architecture with random weights (its family's initialisation, seed "
        f"{a.seed}), analysed the same way, the baseline each verdict is read against"
        if len(labels) > 1
        else " without a random-weight copy (`--no-baseline`): no verdict can be read against the architecture "
        "at initialisation"
    )
    return (
        f"Study A on `{source.name}` ({'a local folder' if source.local else 'from the hub'}), no training,{copy}. "
        f"Settings: k = {a.k} neighbours, {a.anchors} anchors, {layers}, classes {', '.join(a.classes)} (the rest in "
        f"`params.yaml` beside this report). Eval text: {eval_note}.\n"
    )


def _against_random(claims: list[Any], labels: list[str]) -> str:
    """Per claim, the model's verdict beside its random-weight copy's, and what the pair says."""
    from lmgeo.results.study_a.claims import CLAIMS

    model, copy = labels
    verdict = {(c.subject, c.claim): c.verdict for c in claims}
    rows = [f"| claim | `{model}` | `{copy}` (random weights) | reading |", "|---|---|---|---|"]
    for claim in CLAIMS:
        pair = verdict.get((model, claim.name)), verdict.get((copy, claim.name))
        if pair != (None, None):
            shown = [v or "not tested" for v in pair]
            rows.append(f"| {claim.label or claim.name} | {shown[0]} | {shown[1]} | {_reading(*pair)} |")
    return "**Against the random-weight copy.**\n\n" + "\n".join(rows) + "\n"


def _reading(model: str | None, copy: str | None) -> str:
    from lmgeo.results.study_a.claims import CONTRADICTED, NOT_SUPPORTED, SUPPORTED

    holds = {SUPPORTED: True, NOT_SUPPORTED: False, CONTRADICTED: False}
    trained, random = holds.get(model or ""), holds.get(copy or "")
    if trained is None or random is None:
        return "cannot tell: one of the two is undecided"
    return {
        (True, True): "holds at random weights too: the architecture's, not training's",
        (True, False): "holds after training only",
        (False, True): "holds at random weights only: training undid it",
        (False, False): "holds for neither",
    }[(trained, random)]
