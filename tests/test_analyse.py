"""`lmgeo analyse MODEL`: Study A on one causal LM that lmgeo does not train (a tiny Llama), from a folder outside
the checkout with the package's own default settings (the README's command as written), a hub id (from a local
Hugging Face cache, offline), the command line's settings, a random-weight copy beside it; a rerun with nothing to
do; and each bad input refused at once, naming the problem, leaving no folder."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from reliability_helpers import env, preset_overrides
from test_e2e import readme_commands

from lmgeo.commands import analyse as tool
from lmgeo.commands.verify.families import save_tiny_model, tiny_config
from lmgeo.core.errors import InputError
from lmgeo.params import apply_overrides, default_study

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SAMPLE = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 20
# The tiny preset's analysis, for the in-process refusals (k = 40 identifies the local classes at width 32).
TINY = {**preset_overrides("tiny"), "analysis.checkpoints": '["final"]'}
# A rough bound for a refusal measured in a subprocess on a loaded machine: the CLI checks paths before it imports
# torch (under 2 s on a quiet machine); the measurement is printed, the bound only catches an import of torch.
REFUSAL_S = 8.0


def tokenizer(vocab_size: int = 300, eos: bool = False):
    """A byte-level BPE trained on a few lines, as a `PreTrainedTokenizerFast` a model folder holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([SAMPLE], trainer=trainer)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", **({"eos_token": "</s>"} if eos else {}))


def save_model(
    path: Path, model_type: str = "llama", width: int = 32, with_tokenizer: bool = True, eos: bool = True
) -> Path:
    """A tiny random-weight model (seed 1, so that it differs from the random copy analyse makes with seed 0)."""
    tok = tokenizer(eos=eos)
    config = tiny_config(model_type)
    for key, value in {
        "hidden_size": width,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": len(tok),
    }.items():
        if hasattr(config, key):
            setattr(config, key, value)
    save_tiny_model(config, path, seed=1)
    if with_tokenizer:
        tok.save_pretrained(path)
    return path


def lmgeo(cwd: Path, *args: str, extra_env: dict[str, str] | None = None, check: bool = True):
    """`lmgeo ARGS` in `cwd`, this venv's; returns the completed process and its wall time."""
    started = time.monotonic()
    done = subprocess.run(
        [str(BIN / "lmgeo"), *args],
        cwd=cwd,
        env={**env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )
    elapsed = time.monotonic() - started
    if check and done.returncode != 0:
        raise AssertionError(f"lmgeo {shlex.join(args)}: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr}")
    return done, elapsed


def outside_the_checkout(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    root = tmp_path_factory.mktemp(name)
    assert not root.resolve().is_relative_to(REPO), root
    # A params.yaml here that analyse must not read (k = 2 identifies nothing): the settings are the package's.
    (root / "params.yaml").write_text("analysis: {k: 2}\n")
    return root


@pytest.fixture(scope="module")
def analysed(tmp_path_factory) -> tuple[Path, str, Path]:
    """The README's `lmgeo analyse` line as written, in a folder outside the checkout, on a tiny Llama saved where
    the line says."""
    (line,) = readme_commands("lmgeo analyse")
    command, subcommand, model, option, out = shlex.split(line)
    assert (command, subcommand, option) == ("lmgeo", "analyse", "--out"), line
    root = outside_the_checkout(tmp_path_factory, "analyse")
    save_model(root / model)
    done, elapsed = lmgeo(root, subcommand, model, option, out)
    print(f"first run: {elapsed:.0f} s")
    return root / out, done.stdout, root


@pytest.mark.slow  # lmgeo, Ray and the stages in a subprocess
def test_analyse_runs_from_outside_the_checkout_with_the_packages_settings_against_a_random_copy(analysed):
    out, stdout, _ = analysed
    for step in ("[1/5] eval text", "[2/5] extract", "[3/5] fit", "[4/5] perturb", "[5/5] tables and report"):
        assert f"analyse: {step}" in stdout, stdout
    # The model's own tokenizer (its 300 entries), never the default study's 2,048-token BPE.
    assert re.search(r"in my-model's tokenizer \(30\d tokens\)", stdout) and "2,048" not in stdout, stdout
    assert "the verdicts rest on one model and its random-weight copy" in stdout
    study = default_study()
    written = yaml.safe_load((out / "params.yaml").read_text())
    assert written["analysis"]["k"] == study.analysis.k and written["analysis"]["anchors"] == study.analysis.anchors
    assert [m["name"] for m in written["analysis"]["external_models"]] == ["my-model", "my-model-random"]
    text = (out / "report.md").read_text()
    assert text.startswith("# lmgeo analyse: my-model\n") and "../models" not in text
    assert "**Against the random-weight copy.**" in text and "| claim | `my-model` | `my-model-random`" in text
    assert "**One model.** The verdicts rest on one model" in text
    assert "Study B" not in text and (out / "report.html").is_file() and list((out / "figures").glob("*.png"))
    assert not (out / "data" / "models").exists()  # nothing was trained
    assert (out / "models" / "my-model-random" / "model.safetensors").is_file()


@pytest.mark.slow
def test_the_analysis_is_queryable_and_names_both_models_by_their_folder(analysed):
    out, _, _ = analysed
    done, _ = lmgeo(out, "query", "SELECT DISTINCT model FROM geometry ORDER BY model", "--format", "csv")
    assert done.stdout.split() == ["model", "my-model", "my-model-random"], done.stdout
    # the two models differ (seed 1 and the copy's seed 0): their fits are not the same numbers
    medians, _ = lmgeo(
        out,
        "query",
        "SELECT model, round(median(rel_err), 6) AS m FROM fits WHERE sample = 'real' GROUP BY model ORDER BY model",
        "--format",
        "json",
    )
    first, second = json.loads(medians.stdout)
    assert first["m"] != second["m"], medians.stdout


@pytest.mark.slow
def test_a_rerun_with_nothing_to_do_returns_at_once(analysed):
    """Measured: on the 2-core machine, loaded, about 1.4 s (the first run: about 2 minutes)."""
    out, _, root = analysed
    report = (out / "report.md").read_bytes()
    done, elapsed = lmgeo(root, "analyse", "./models/my-model", "--out", out.name)
    print(f"rerun with nothing to do: {elapsed:.2f} s")
    assert done.stdout.startswith("analyse: nothing to do:") and elapsed < 30, (elapsed, done.stdout)
    assert (out / "report.md").read_bytes() == report


# ------------------------------------------------------------------------------------ a hub id, offline
def hub_cache(root: Path, repo_id: str, source: Path) -> dict[str, str]:
    """A Hugging Face cache under `root` holding `source` as `repo_id`'s main revision, and the environment that
    makes transformers read it offline (as a node that downloaded it before would)."""
    snapshot = "0123456789abcdef0123456789abcdef01234567"
    repo = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "snapshots" / snapshot).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot)
    for file in source.iterdir():
        (repo / "snapshots" / snapshot / file.name).write_bytes(file.read_bytes())
    return {"HF_HOME": str(root), "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_a_hub_id_with_the_command_lines_settings_and_no_copy(tmp_path_factory):
    """`lmgeo analyse org/name --k … --anchors … --classes … --layers … --no-baseline`: the hub id resolved through
    the local cache (transformers' own loading, offline), only the chosen layer and classes fitted."""
    root = outside_the_checkout(tmp_path_factory, "hub")
    # a tokenizer without an end-of-text token: the eval text is split by a BPE, then re-encoded with the model's
    extra = hub_cache(root / "hf", "lmgeo-test/tiny-llama", save_model(root / "saved", eos=False))
    done, _ = lmgeo(
        root,
        "analyse",
        "lmgeo-test/tiny-llama",
        "--k",
        "40",
        "--anchors",
        "32",
        "--classes",
        "lowrank,identity",
        "--layers",
        "1",
        "--no-baseline",
        extra_env=extra,
    )
    out = root / "analyse-lmgeo-test--tiny-llama"
    assert "the verdicts rest on one model:" in done.stdout, done.stdout
    assert "split into documents by a BPE trained on it (lmgeo-test/tiny-llama's tokenizer has no end-of-text" in (
        done.stdout
    )
    rows, _ = lmgeo(out, "query", "SELECT DISTINCT model, layer, fn FROM fits ORDER BY fn", "--format", "json")
    assert json.loads(rows.stdout) == [
        {"model": "lmgeo-test/tiny-llama", "layer": 1, "fn": f} for f in ("identity", "lowrank", "lowrank.layer")
    ], rows.stdout
    text = (out / "report.md").read_text()
    assert "(from the hub)" in text and "without a random-weight copy" in text and "layers 1" in text
    assert "Against the random-weight copy" not in text


def test_the_command_lines_settings_become_overrides_the_params_validate() -> None:
    settings = tool.overrides(k=40, anchors=32, classes=["lowrank,identity", "diag_psd"], layers=["0,1"])
    assert settings == {
        "analysis.k": "40",
        "analysis.anchors": "32",
        "analysis.classes": '["lowrank", "identity", "diag_psd"]',
        "analysis.layers": "[0, 1]",
    }
    params = apply_overrides(default_study(), settings)
    assert (params.analysis.k, params.analysis.anchors, params.analysis.layers) == (40, 32, [0, 1])
    assert params.analysis.classes == ["lowrank", "identity", "diag_psd"]
    assert tool.overrides() == {}


# -------------------------------------------------------------------------------------------- refusals
def bert(path: Path) -> Path:
    from transformers import BertConfig, BertForMaskedLM

    tok = tokenizer()
    config = BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    BertForMaskedLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    root = outside_the_checkout(tmp_path_factory, "refusals")
    save_model(root / "llama")
    save_model(root / "bare", with_tokenizer=False)
    bert(root / "bert")
    (root / "study").mkdir()
    (root / "study" / "dvc.yaml").write_text("stages: {}\n")
    (root / "full").mkdir()
    (root / "full" / "notes.txt").write_text("mine\n")
    return root


REFUSALS = {
    "no folder": (["./models/nowhere"], "./models/nowhere: no such folder"),
    "no tokenizer": (["bare"], "bare: no tokenizer files beside the model"),
    "not a causal LM": (["bert"], "bert: not a causal LM (config.json: BertForMaskedLM, model type 'bert')"),
    "an existing study as --out": (["llama", "--out", "study"], "--out study: holds a study (dvc.yaml)"),
    "a folder of other files as --out": (["llama", "--out", "full"], "--out full: not empty"),
}


@pytest.mark.slow  # a fresh interpreter per case
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_bad_input_is_one_error_line_at_once_leaving_no_folder(folders: Path, case: str) -> None:
    args, message = REFUSALS[case]
    before = sorted(p.name for p in folders.iterdir())
    done, elapsed = lmgeo(folders, "analyse", *args, check=False)
    print(f"{case}: refused in {elapsed:.2f} s")
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"lmgeo: error: {message}"), line
    assert "sentencepiece" not in line and elapsed < REFUSAL_S, (line, elapsed)
    assert sorted(p.name for p in folders.iterdir()) == before  # no analyse-<name> left behind


def test_the_quick_causal_check_never_refuses_a_causal_lm_and_refuses_encoders() -> None:
    """The name check that runs without torch, against transformers' own lists: every causal LM class passes (the
    full check then reads the model type); encoders, masked LMs and classifiers are refused, but for a few
    `...ForConditionalGeneration` / `...WithLMHeadModel` names left to the full check."""
    from transformers.models.auto import modeling_auto as auto

    causal = set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    assert all(tool._CAUSAL_NAME.search(name) for name in causal)
    others = set()
    for mapping in (
        auto.MODEL_MAPPING_NAMES,
        auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    ):
        for names in mapping.values():
            others.update(names if isinstance(names, tuple) else [names])
    others -= causal
    passed = sorted(name for name in others if tool._CAUSAL_NAME.search(name))
    assert len(others) > 500 and len(passed) < 0.02 * len(others), passed
    assert {"BertForMaskedLM", "BertModel", "RobertaForMaskedLM", "T5EncoderModel"}.isdisjoint(passed)


def test_out_may_be_an_earlier_analysis_of_the_same_model_only(tmp_path: Path) -> None:
    source = tool.ModelSource(str(tmp_path / "my-model"), "my-model")
    out = tmp_path / "analysis"
    assert tool.output_folder(out, source) == out  # new
    out.mkdir()
    assert tool.output_folder(out, source) == out  # empty
    tool._write_marker(out, source, None)
    (out / "params.yaml").write_text("written by analyse\n")
    assert tool.output_folder(out, source) == out  # ours: resumed
    with pytest.raises(InputError, match="holds the analysis of my-model, not other"):
        tool.output_folder(out, tool.ModelSource(str(tmp_path / "other"), "other"))
    assert tool.output_folder(None, source) == Path("analyse-my-model")


def _refusal(tmp_path: Path, model: Path, **overrides: str) -> str:
    """The refusal of `lmgeo.commands.analyse.run`, in process (before any stage: the folder it created is gone)."""
    params = apply_overrides(default_study(), {**TINY, **overrides})
    out = tmp_path / "out"
    with pytest.raises(InputError) as refused:
        tool.run(params, source=tool.locate_model(str(model)), out=out)
    assert not out.exists()
    return str(refused.value)


def test_an_unverified_family_is_refused_before_extraction(tmp_path):
    message = _refusal(tmp_path, save_model(tmp_path / "gpt1", model_type="openai-gpt"))
    assert "no final norm" in message, message


def test_a_model_too_wide_for_k_is_refused_before_extraction_naming_the_option(tmp_path):
    message = _refusal(tmp_path, save_model(tmp_path / "wide", width=64), **{"analysis.k": "20"})
    assert "analysis.k (20)" in message and "d = 64" in message and "`lmgeo analyse --k`" in message, message
    assert os.listdir(tmp_path) == ["wide"]


def test_a_stage_works_in_the_layout_it_is_given_and_analyse_never_changes_the_cwd(tmp_path, monkeypatch):
    """A stage's workspace is its `layout` argument, not the working directory: `prepare`, run from another folder,
    writes its tokens and tokenizer into the layout and nothing where it runs. So `lmgeo analyse` runs the stages
    in its `--out` folder without changing the cwd (which would also change it for the process's other threads):
    a `chdir` fails this test, as it would in analyse's refusal before any stage."""
    from lmgeo.driver.layout import Layout
    from lmgeo.stages import prepare

    def no_chdir(path: object) -> None:
        raise AssertionError(f"os.chdir({path!r})")

    workspace, elsewhere = tmp_path / "workspace", tmp_path / "elsewhere"
    workspace.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(os, "chdir", no_chdir)  # contextlib.chdir calls it too
    prepare.run(apply_overrides(default_study(), TINY), Layout(workspace))
    assert (workspace / "data" / "tokens" / "meta.json").is_file() and any((workspace / "data" / "tokenizer").iterdir())
    assert not any(elsewhere.iterdir())
    message = _refusal(tmp_path, save_model(tmp_path / "wide", width=64), **{"analysis.k": "20"})
    assert "analysis.k (20)" in message, message
