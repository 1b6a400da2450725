"""Reliability and security (SPEC §7), by real fault injection on a reduced tiny preset.

Each case kills a real process, corrupts a real file or feeds real bad input to the `lmgeo` commands,
and checks the outcome: a complete result equal to an undisturbed run's, or exit code 2 with one
message naming the cause, and `data/` untouched.

Workspaces (module-scoped, each stage run at most once per workspace and copied for every case that
needs a pristine state):
- `prepared`: params (tiny preset, one arch, `adamw` plus a `hilbert` run made to diverge, the `mlp`
  class so that fit shards last seconds) committed to git, then `lmgeo prepare`;
- `extracted`: a copy of `prepared` after `train` and `extract`;
- `reference`: a copy of `extracted` after `fit`, `perturb`, `aggregate`, `report` (run A, undisturbed);
- `second_run`: a copy of `prepared` after `train` … `report` (run B, for determinism).

Shard manifests carry the code version (a hash of the code each stage runs): editing that code while this
file runs makes re-runs redo complete shards, and the resume checks fail.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from reliability_helpers import (
    STAGE_TIMEOUT_S,
    alive,
    busy_worker,
    copy_workspace,
    dataset_rows,
    kill_all,
    kill_group,
    lmgeo,
    manifest_times,
    preset_overrides,
    rewrite_shard,
    run_pipeline,
    snapshot,
    start_stage,
    stop,
    title,
    wait_for,
    watching,
    write_params,
    write_raw_params,
)

from lmgeo.core.contracts import arrow_to_vectors, vectors_to_arrow
from lmgeo.core.store import manifest_path, verify_shard

pytestmark = pytest.mark.slow

TRAINED = "neox-adamw-s0"
DIVERGING = "neox-hilbert-s0"
MODEL = f"{TRAINED}.final"  # the only analysed model: the diverged run's final checkpoint is left out
STUDY = {
    **preset_overrides("tiny"),
    "train.matched_budget": "null",  # these cases count their runs' shards: no matched-budget runs
    "train.archs": '["neox"]',
    "train.recipes": '["adamw","hilbert"]',
    # A head step that overflows the logits at step 2: non-finite loss, a diverged run.
    "train.recipe_overrides": '{"hilbert":{"head_lr":1.0e38}}',
    "analysis.classes": '["diag_psd","identity","mlp"]',
    # An mlp fit shard lasts seconds, long enough to be killed mid-way: every one of its steps runs (a
    # tolerance no anchor meets), so how long it lasts does not hang on how fast the fit converges.
    "analysis.mlp_steps": "3000",
    "analysis.mlp_tol": "1.0e-12",
}
FIT_SHARDS = 2  # one per layer: a fit task searches a layer's neighbours once for every class
FIT_ORDER = ["model", "layer", "fn", "seq_id", "pos"]
GIT = ("git", "-c", "user.email=ci@lmgeo", "-c", "user.name=ci")


# ------------------------------------------------------------------------------------- workspaces
@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    workspace = tmp_path_factory.mktemp("prepared")
    write_params(workspace, STUDY)
    for cmd in (("git", "init", "-q"), ("git", "add", "params.yaml"), (*GIT, "commit", "-qm", "reliability study")):
        subprocess.run(cmd, cwd=workspace, check=True, capture_output=True)
    lmgeo(workspace, "prepare")
    return workspace


@pytest.fixture(scope="module")
def extracted(prepared, tmp_path_factory) -> Path:
    workspace = copy_workspace(prepared, tmp_path_factory.mktemp("extracted") / "ws")
    run_pipeline(workspace, "train", "extract")
    return workspace


@pytest.fixture(scope="module")
def reference(extracted, tmp_path_factory) -> Path:
    workspace = copy_workspace(extracted, tmp_path_factory.mktemp("reference") / "ws")
    run_pipeline(workspace, "fit", "perturb", "aggregate", "report")
    return workspace


@pytest.fixture(scope="module")
def second_run(prepared, tmp_path_factory) -> Path:
    workspace = copy_workspace(prepared, tmp_path_factory.mktemp("second_run") / "ws")
    run_pipeline(workspace, "train", "extract", "fit", "perturb", "aggregate", "report")
    return workspace


def fits_of(workspace: Path) -> pa.Table:
    return dataset_rows(workspace / "data" / "fits", FIT_ORDER)


# ---------------------------------------------------------------------------- 1. killed Ray worker
def test_killed_fit_worker_is_retried_and_the_result_is_unchanged(extracted, reference, tmp_path):
    workspace = copy_workspace(extracted, tmp_path / "ws")
    log = tmp_path / "fit.log"
    driver = start_stage(workspace, "fit", log)
    try:
        victim = wait_for(busy_worker(driver.pid, "ray::fit_task", for_s=1.0), 120, "a fit task running for 1 s")
        assert title(victim).startswith("ray::fit_task")
        victim.kill()  # SIGKILL, mid-shard: Ray's max_retries must run the shard again
        returncode = driver.wait(timeout=STAGE_TIMEOUT_S)
    finally:
        stop(driver)
    output = log.read_text()
    assert returncode == 0, output[-4000:]
    assert "will be retried" in output, output[-4000:]  # Ray saw the worker die mid-task
    assert len(manifest_times(workspace / "data" / "fits")) == FIT_SHARDS
    assert fits_of(workspace).equals(fits_of(reference))


# --------------------------------------------------------------------- 2. killed driver, then re-run
def test_killed_driver_leaves_no_ray_processes_and_the_rerun_resumes(extracted, reference, tmp_path):
    # The kill races the second shard (both run in one task, a second or two apart): on a loaded machine it
    # can land after both, so the case is tried afresh up to three times until it lands between them.
    for attempt in range(3):
        workspace = copy_workspace(extracted, tmp_path / f"ws{attempt}")
        fits = workspace / "data" / "fits"
        driver = start_stage(workspace, "fit", tmp_path / f"fit{attempt}.log")
        seen, first_shard = watching(driver.pid, lambda: manifest_times(fits))
        try:
            wait_for(first_shard, 120, "a first complete fit shard")
            family = seen | kill_group(driver)
        finally:
            stop(driver)
        done_before = manifest_times(fits)
        if len(done_before) == FIT_SHARDS:
            # Too late: the driver may already have been shutting Ray down, so its Ray processes can be gone
            # before the kill (seen on a loaded CI machine as "Ray never ran"). Try afresh.
            kill_all(alive(family))
            continue
        assert any(name.startswith("ray::") or "raylet" in name for name in family.values()), (
            f"Ray never ran: {len(done_before)}/{FIT_SHARDS} shards done; the driver's family: {list(family.values())}"
        )
        try:
            wait_for(lambda: not alive(family), 30, "the killed driver's Ray processes to exit")
        finally:
            leaked = alive(family)
            kill_all(leaked)
        assert not leaked, f"Ray processes outlived their driver: {[title(p) for p in leaked]}"
        break
    assert 0 < len(done_before) < FIT_SHARDS, "in three tries the kill never landed between the two shards"
    rerun = lmgeo(workspace, "fit")
    n = len(done_before)
    assert f"fit: {n}/{FIT_SHARDS} shards complete, {FIT_SHARDS - n} to do" in rerun.stdout, rerun.stdout
    after = manifest_times(fits)
    assert {name: after[name] for name in done_before} == done_before, "finished shards were redone"
    assert len(after) == FIT_SHARDS
    assert not [p for p in fits.rglob("*") if ".tmp-" in p.name], "leftovers of the killed writes remain"
    assert fits_of(workspace).equals(fits_of(reference))


def test_killed_train_driver_redoes_only_the_unfinished_run(prepared, tmp_path):
    """`lmgeo train` killed after its first run finished: the re-run skips that run and redoes the other."""
    workspace = copy_workspace(prepared, tmp_path / "ws")
    write_params(workspace, {"train.recipes": '["adamw","muon"]', "train.steps": "60", "ray.max_in_flight": "1"})
    first, second = "neox-adamw-s0", "neox-muon-s0"
    marker = manifest_path(workspace / "data" / "models", first)  # written last: the run is complete
    driver = start_stage(workspace, "train", tmp_path / "train.log")
    try:
        wait_for(marker.is_file, 300, "the first run's completion marker")
        # Everything at once, workers included: a Ray worker runs in its own process group and would
        # otherwise finish the shard it holds (atomically, so that too would be a valid resume).
        kill_all(kill_group(driver))
    finally:
        stop(driver)
    assert not manifest_path(workspace / "data" / "models", second).exists(), "the kill came too late"
    finished_at = marker.stat().st_mtime_ns
    rerun = lmgeo(workspace, "train")
    assert "train: 1/2 shards complete, 1 to do" in rerun.stdout, rerun.stdout
    assert marker.stat().st_mtime_ns == finished_at, "the finished run was redone"
    for run in (first, second):
        assert json.loads((workspace / "data" / "models" / run / "final" / "run.json").read_text())["steps_done"] == 60
        assert (workspace / "data" / "train" / f"run={run}" / "steps.parquet").is_file()


# ------------------------------------------------------------------------ 3. corrupt Parquet shard
def test_corrupt_activation_shard_is_named_then_rebuilt(reference, tmp_path):
    workspace = copy_workspace(reference, tmp_path / "ws")
    activations, fits = workspace / "data" / "activations", workspace / "data" / "fits"
    shard = f"{MODEL}/seq=4"
    files = verify_shard(activations, shard)  # layer=0, layer=1, layer=2
    original = {path: path.read_bytes() for path in files}
    truncated, garbled = files[1], files[2]
    truncated.write_bytes(original[truncated][: len(original[truncated]) // 2])
    garbled.write_bytes(garbage(len(original[garbled])))
    corrupt = snapshot(workspace / "data")

    for stage in ("fit", "perturb"):  # both read activations; neither may read the corrupt shard
        refused = lmgeo(workspace, stage, check=False)
        assert_one_error(refused, str(truncated), "truncated", f"re-run the stage that writes {activations}")
    query = lmgeo(workspace, "query", "SELECT count(*) FROM activations", check=False)
    assert_one_error(query, str(truncated), "corrupt shard")
    assert snapshot(workspace / "data") == corrupt, "a refused stage wrote to data/"

    rebuilt = lmgeo(workspace, "extract")
    assert "extract: 3/4 shards complete, 1 to do" in rebuilt.stdout, rebuilt.stdout
    assert {path: path.read_bytes() for path in verify_shard(activations, shard)} == original
    refit = lmgeo(workspace, "fit")  # the rebuilt shard is the original: nothing downstream to redo
    assert f"fit: {FIT_SHARDS}/{FIT_SHARDS} shards complete, 0 to do" in refit.stdout, refit.stdout

    (fit_file,) = [f for f in verify_shard(fits, f"{MODEL}/layer=1") if "fn=mlp" in f.parts]
    fit_file.write_bytes(garbage(fit_file.stat().st_size))
    reports = snapshot(workspace / "reports")
    aggregate = lmgeo(workspace, "aggregate", check=False)  # DuckDB over the fits
    assert_one_error(aggregate, str(fit_file), "sha256", f"re-run the stage that writes {fits}")
    assert snapshot(workspace / "reports") == reports


def garbage(size: int) -> bytes:
    """`size` random bytes: a file overwritten in place keeps its size, so only its sha256 tells."""
    return np.random.default_rng(0).bytes(size)


def assert_one_error(done: subprocess.CompletedProcess, *names: str) -> None:
    """Exit code 2 and one `lmgeo: error:` message, no traceback, naming every one of `names`."""
    shown = f"exit {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-4000:]}"
    assert done.returncode == 2, shown
    assert done.stderr.count("lmgeo: error:") == 1 and "Traceback" not in done.stderr, shown
    for name in names:
        assert name in done.stderr, f"{name!r} not named:\n{shown}"


# ------------------------------------------------------------------------------- 4. bad input
@pytest.fixture(scope="module")
def inputs(extracted, tmp_path_factory) -> Path:
    """A copy of `extracted` holding the model folders the input cases load, and one outside it."""
    root = tmp_path_factory.mktemp("inputs")
    workspace = copy_workspace(extracted, root / "ws")
    models = workspace / "models"
    save_tiny_model(models / "remote", config_extra={"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}})
    save_tiny_model(models / "pickle", pickle_only=True)
    save_tiny_llama(models / "llama", workspace / "data" / "tokenizer")
    save_tiny_model(root / "outside_model")
    (workspace / "escape").symlink_to(root / "outside_model")
    (root / "outside.txt").write_text("text outside the workspace\n" * 100)
    (workspace / "empty").mkdir()
    (workspace / "empty" / "a.txt").write_text("")
    return workspace


def save_tiny_model(path: Path, config_extra: dict | None = None, pickle_only: bool = False) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        tie_word_embeddings=False,
    )
    GPTNeoXForCausalLM(config).save_pretrained(path)
    if config_extra:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, **config_extra}))
    if pickle_only:  # transformers 5 always writes safetensors: convert to a plain torch pickle
        weights = path / "model.safetensors"
        torch.save(load_file(weights), path / "pytorch_model.bin")
        weights.unlink()


def save_tiny_llama(path: Path, tokenizer: Path) -> None:
    """A Llama (with the workspace's tokenizer beside it) whose config carries Cohere's `logit_scale`, which
    Llama does not apply: its readout cannot be reproduced, so verification must refuse it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "logit_scale": 3.0}))


def run_all(workspace: Path, commands: dict[str, tuple[str, ...]]) -> dict[str, subprocess.CompletedProcess]:
    """Each labelled `lmgeo` command line, a few at a time (they are independent and short)."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {label: pool.submit(lmgeo, workspace, *args, check=False) for label, args in commands.items()}
        return {label: future.result() for label, future in futures.items()}


def setting(section: str, **values) -> Callable[[dict], None]:
    """An edit of raw params: set `values` in `section`."""
    return lambda raw: raw[section].update(values)


def external(model_id: str) -> Callable[[dict], None]:
    return setting("analysis", external_models=[{"id": model_id}])


def corpus(pattern: str) -> Callable[[dict], None]:
    return setting("prepare", corpus={"source": "files", "paths": [pattern]})


def refused_everywhere(workspace: Path, cases: dict[str, tuple[str, Callable[[dict], None], tuple[str, ...]]]) -> None:
    """Run `lmgeo <stage> --params <case>.yaml` for every case (stage, edit of params, words the one
    error message must contain); each must exit 2 with that message and leave data/ as it was."""
    before = snapshot(workspace / "data")
    commands = {}
    for label, (stage, edit, _) in cases.items():
        write_raw_params(workspace, f"{label}.yaml", edit)
        commands[label] = (stage, "--params", f"{label}.yaml")
    results = run_all(workspace, commands)
    for label, (_, _, words) in cases.items():
        assert_one_error(results[label], *words)
    assert snapshot(workspace / "data") == before, "a refused command changed data/"


def test_malformed_params_exit_2_naming_the_key(inputs):
    (inputs / "syntax.yaml").write_text("prepare: {seq_len: [\n")
    syntax = lmgeo(inputs, "fit", "--params", "syntax.yaml", check=False)
    assert_one_error(syntax, "syntax.yaml", "not valid YAML")
    refused_everywhere(
        inputs,
        {
            "unknown_key": ("train", setting("analysis", neighbours=8), ("unknown key 'analysis.neighbours'",)),
            "wrong_type": ("fit", setting("analysis", k="eight"), ("analysis.k", "'eight'")),
            "k_too_large": ("fit", setting("analysis", k=10**6), ("analysis.k (1000000)", "pool")),
            "unknown_recipe": ("train", setting("train", recipes=["adamw", "lion"]), ("train.recipes", "'lion'")),
            "unknown_class": ("fit", setting("analysis", classes=["kernel"]), ("analysis.classes", "'kernel'")),
            # Beyond float32's range torch refuses the step with an overflow error, failing every run of the stage.
            "huge_step": (
                "train",
                setting("train", recipe_overrides={"hilbert": {"head_lr": 1e300}}),
                ("train.recipe_overrides.hilbert.head_lr", "less than or equal"),
            ),
        },
    )


def test_missing_or_unsupported_model_and_empty_corpus_exit_2(inputs):
    refused_everywhere(
        inputs,
        {
            "missing_model": ("extract", external("./no/such/model"), ("./no/such/model", "does not exist")),
            "unverified_model": ("extract", external("./models/llama"), ("verification failed: readout",)),
            "empty_corpus": ("prepare", corpus("empty/*.txt"), ("empty/*.txt", "empty")),
        },
    )


# ------------------------------------------------------------------------------- 5. NaN/Inf activations
def test_nonfinite_activations_are_counted_and_excluded(extracted, tmp_path):
    workspace = copy_workspace(extracted, tmp_path / "ws")
    poisoned = {3: np.nan, 10: np.nan, 17: np.inf, 21: -np.inf, 30: np.nan}  # row -> value, in h_1

    def poison(partition: dict[str, str], table: pa.Table) -> pa.Table:
        if partition["layer"] != "1":
            return table
        h = arrow_to_vectors(table["h"]).copy()
        for row, value in poisoned.items():
            h[row, row % h.shape[1]] = value  # one bad coordinate is enough to exclude the token
        return table.set_column(table.schema.get_field_index("h"), "h", vectors_to_arrow(h))

    shard = f"{MODEL}/seq=0"
    rewrite_shard(workspace / "data" / "activations", shard, poison)
    verify_shard(workspace / "data" / "activations", shard)  # a valid shard, as a stage would write it
    layer1 = dataset_rows(workspace / "data" / "activations", ["seq_id", "pos"])
    layer1 = layer1.filter(pc.equal(layer1["layer"], "1"))
    bad_tokens = {(layer1["seq_id"][r].as_py(), layer1["pos"][r].as_py()) for r in poisoned}
    assert len(bad_tokens) == len(poisoned)

    run_pipeline(workspace, "fit", "perturb", "aggregate", "report")
    fits = fits_of(workspace)
    assert set(pc.unique(fits["n_nonfinite"]).to_pylist()) == {len(poisoned)}  # both layers see h_1
    anchors = set(zip(fits["seq_id"].to_pylist(), fits["pos"].to_pylist(), strict=True))
    assert not anchors & bad_tokens, "a non-finite token was used as an anchor"
    assert pc.all(pc.is_finite(fits["rel_err"])).as_py()

    tables = workspace / "reports" / "tables"
    per_layer = pq.read_table(tables / "geometry.parquet").to_pylist()
    assert per_layer and all(g["n_nonfinite"] == len(poisoned) and g["n_nonfinite_values"] == 0 for g in per_layer)
    pooled = pq.read_table(tables / "geometry_pooled.parquet").to_pylist()
    assert pooled and all(g["n_nonfinite"] == 2 * len(poisoned) for g in pooled)
    report = (workspace / "reports" / "report.md").read_text()
    assert "excluded non-finite" in report
    rows = [r for r in report.splitlines() if r.startswith(f"| `{TRAINED}@final`") and "pool tokens" in r]
    assert len(rows) == 1 and f"| {2 * len(poisoned)} pool tokens, 0 anchors |" in rows[0], rows


# ------------------------------------------------------------------------------------ 6. diverging run
def test_diverged_run_is_marked_and_the_pipeline_completes(extracted, reference):
    diverged = json.loads((extracted / "data" / "models" / DIVERGING / "final" / "run.json").read_text())
    healthy = json.loads((extracted / "data" / "models" / TRAINED / "final" / "run.json").read_text())
    assert diverged["diverged"] is True and diverged["diverged_at_step"] is not None
    assert healthy["diverged"] is False and math.isfinite(healthy["final_val_loss"])
    assert not list((reference / "data" / "activations").glob(f"model={DIVERGING}*")), "diverged weights analysed"
    runs = {r["run"]: r for r in pq.read_table(reference / "reports" / "tables" / "runs.parquet").to_pylist()}
    assert runs[DIVERGING]["diverged"] and not runs[TRAINED]["diverged"]
    report = (reference / "reports" / "report.md").read_text()
    diverged_line = next(line for line in report.splitlines() if line.startswith("- **Runs.**"))
    assert f"`{DIVERGING}`" in diverged_line and TRAINED not in diverged_line
    assert "## Study A" in report and f"`{TRAINED}@final`" in report


# ------------------------------------------------------------------------------------- 7. determinism
def test_two_runs_give_the_same_results_and_the_report_says_how(reference, second_run):
    """Run A (`reference`) and run B (`second_run`): train … report twice from one prepared workspace."""
    a, b = ((w / "reports" / "metrics.json").read_bytes() for w in (reference, second_run))
    assert a == b
    headline = json.loads(a)  # one flat object of short names; the detail is in the tables below
    assert headline and all(isinstance(v, float) for v in headline.values()), headline
    for dataset, order in (
        ("activations", ["model", "layer", "seq_id", "pos"]),
        ("fits", FIT_ORDER),
        ("perturb", FIT_ORDER),
    ):
        rows_a, rows_b = (dataset_rows(w / "data" / dataset, order) for w in (reference, second_run))
        assert rows_a.num_rows and rows_a.equals(rows_b), dataset

    report = (second_run / "reports" / "report.md").read_text()
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=second_run, capture_output=True, text=True, check=True)
    revision = git.stdout.strip()
    for needed in (
        f"revision `{revision}`",
        "**params_hash**: `",
        "**seeds**",
        "train `0`",
        "**packages**",
        "torch `",
        "transformers `",
        "lmgeo `",
        "**data_checksums**",
        "params.yaml: `sha256:",
        "data/tokens/meta.json: `sha256:",
    ):
        assert needed in report, f"{needed!r} missing from the report's provenance"
    params_hash = re.search(r"\*\*params_hash\*\*: `(\w+)`", report).group(1)
    assert f"**params_hash**: `{params_hash}`" in (reference / "reports" / "report.md").read_text()


# ------------------------------------------------------------------------------------- 8. security
def test_remote_code_and_pickle_weights_are_refused(inputs):
    from lmgeo.models.loading import check_model

    refused_everywhere(
        inputs,
        {
            "remote_code": ("extract", external("./models/remote"), ("auto_map", "security.trust_remote_code")),
            "pickle_only": ("extract", external("./models/pickle"), ("pickle", "safetensors")),
        },
    )
    # The refusal is the flag's doing: with trust_remote_code the same folder passes the checks.
    assert check_model("./models/remote", trust_remote_code=True, workspace=inputs).endswith("models/remote")


def test_paths_cannot_leave_the_workspace(inputs):
    from lmgeo.models.loading import check_model

    outside = inputs.parent / "outside_model"
    refused_everywhere(
        inputs,
        {
            "relative_model": (
                "extract",
                external("../outside_model"),
                ("../outside_model", "outside the workspace", "security.allow_outside_paths"),
            ),
            "absolute_model": ("extract", external(str(outside)), (str(outside), "outside the workspace")),
            "symlinked_model": ("extract", external("./escape"), ("./escape", "outside the workspace")),
            "corpus_glob": ("prepare", corpus("../*.txt"), ("outside the workspace", "security.allow_outside_paths")),
        },
    )
    assert check_model(str(outside), workspace=inputs, allow_outside_paths=True) == str(outside)


def test_query_cannot_write(reference):
    statements = {  # SQL -> what the one error message says
        "COPY (SELECT 1 AS x) TO 'leak.csv'": "read-only",
        "ATTACH 'leak.duckdb' AS leak": "read-only",
        "CREATE TABLE leak AS SELECT 1 AS x": "read-only",
        "INSTALL httpfs": "read-only",
        "EXPLAIN ANALYZE COPY (SELECT 1) TO 'leak.csv'": "read-only",  # EXPLAIN ANALYZE would run the COPY
        "SELECT 1; COPY (SELECT 1) TO 'leak.csv'": "exactly one SQL statement",
        "SELECT * FROM read_csv('params.yaml')": "file system operations are disabled",  # only the result tables
    }
    before = snapshot(reference)
    results = run_all(reference, {sql: ("query", sql) for sql in statements})
    for sql, says in statements.items():
        assert_one_error(results[sql], says)
    assert snapshot(reference) == before, "a refused query changed the workspace"
    allowed = lmgeo(reference, "query", "SELECT count(*) AS n FROM fits", "--format", "json")
    assert json.loads(allowed.stdout)[0]["n"] > 0
