"""params.yaml validation: every kind of error exits with code 2 before any work, naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmgeo.core.config import ParamsError
from lmgeo.params import load_params, parse_params

REPO = Path(__file__).resolve().parents[1]


def test_default_params_are_valid():
    params = load_params(REPO / "params.yaml")
    assert params.train.runs()  # a non-empty grid
    assert params.prepare.tokenizer.vocab_size > params.train.model.d_model  # V >> d for Study B


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"train": {"stepz": 3}}, "unknown key 'train.stepz'"),
        ({"bogus": {}}, "unknown key 'bogus'"),
        ({"train": {"steps": "3"}}, "train.steps: Input should be a valid integer"),
        ({"train": {"steps": 0}}, "train.steps: Input should be greater than or equal to 1"),
        ({"prepare": {"val_fraction": 1.5}}, "prepare.val_fraction"),
        (
            {"prepare": {"val_fraction": 0.5, "test_fraction": 0.5}},
            "val_fraction + test_fraction must leave a train split",
        ),
        ({"train": {"recipe_overrides": {"hilbert_equi": {"equi_alignment": 1.5}}}}, "equi_alignment"),
        ({"train": {"matched_budget": {"taus": [0.1, 0], "seeds": [0]}}}, "train.matched_budget.taus.1"),
        ({"train": {"matched_budget": {"taus": [0.5], "seeds": []}}}, "matched_budget.seeds"),
        ({"train": {"matched_budget": {"taus": [0.5, 0.5], "seeds": [0]}}}, "matched_budget.taus"),
        ({"train": {"recipes": ["adamw", "lion"]}}, "train.recipes.1: unknown recipe 'lion'; registered: adamw, muon"),
        ({"analysis": {"classes": ["diag_psd", "kernel"]}}, "analysis.classes.1: unknown function class 'kernel'"),
        # registered names are checked wherever a section holds one (lmgeo.params walks the sections)
        ({"train": {"archs": ["neox", "llama"]}}, "train.archs.1: unknown model family 'llama'; registered: gpt2"),
        ({"train": {"recipe_overrides": {"lion": {"head_lr": 0.1}}}}, "train.recipe_overrides.lion.[key]: unknown"),
        ({"analysis": {"runs": {"archs": ["llama"]}}}, "analysis.runs.archs.0: unknown model family 'llama'"),
        ({"analysis": {"runs": {"recipes": ["muon", "lion"]}}}, "analysis.runs.recipes.1: unknown recipe 'lion'"),
        ({"train": {"archs": []}}, "train: archs must not be empty"),
        ({"analysis": {"classes": ["lowrank", "lowrank"]}}, "analysis: classes has duplicates"),
        ({"analysis": {"null_directions": 1}}, "analysis.null_directions: Input should be greater than or equal to 8"),
        ({"analysis": {"k": 5000}}, "analysis.k (5000) must be smaller than the pool"),
        ({"train": {"model": {"d_model": 30, "n_heads": 4}}}, "divisible by n_heads"),
        ({"train": {"recipe_overrides": {"muon": {"tau": 0.1}}}}, "train.recipe_overrides.muon.tau: tau applies"),
        ({"prepare": {"corpus": {"source": "files"}}}, "corpus.paths must name at least one path"),
        # Values a task would crash on are refused here, before a stage deletes anything.
        ({"train": {"seeds": [18446744073709551616]}}, "train.seeds.0: Input should be less than or equal to"),
        (
            {
                "analysis": {"exclude_same_sequence": True, "eval_sequences": 2, "k": 100, "anchors": 10},
                "prepare": {"seq_len": 64},
            },
            "too few neighbours once an anchor's own sequence",
        ),
    ],
)
def test_each_kind_of_error_names_the_key(raw, needle):
    with pytest.raises(ParamsError) as err:
        parse_params(raw)
    assert needle in str(err.value)


def test_every_unknown_name_is_reported_on_its_own_line():
    with pytest.raises(ParamsError) as err:
        parse_params({"train": {"recipes": ["lion"]}, "analysis": {"runs": {"archs": ["llama"]}}})
    lines = str(err.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == ["train.recipes.0", "analysis.runs.archs.0"]
    assert all(line.startswith("params.yaml: ") for line in lines)


def test_names_left_out_are_every_registered_one():
    """The sections cannot see the registries (they are imported by them): `lmgeo.params` fills these in,
    whether the section is left out, given without the key, or given as an object."""
    from lmgeo.models.registry import FAMILIES
    from lmgeo.params import Params
    from lmgeo.study_a.classes import FIT_CLASSES
    from lmgeo.study_a.config import AnalysisConfig
    from lmgeo.study_b.config import TrainConfig
    from lmgeo.study_b.recipes import RECIPES

    trainable = [family.name for family in FAMILIES if family.trainable]
    for params in (
        parse_params({}),
        parse_params({"train": {"steps": 3}, "analysis": {"k": 8}}),
        Params(train=TrainConfig(steps=3), analysis=AnalysisConfig(k=8)),
        Params(),
    ):
        assert params.train.archs == trainable
        assert params.train.recipes == list(RECIPES.names())
        assert params.analysis.classes == list(FIT_CLASSES.names())
    given = parse_params({"train": {"archs": ["neox"], "recipes": ["muon"]}, "analysis": {"classes": ["lowrank"]}})
    assert (given.train.archs, given.train.recipes, given.analysis.classes) == (["neox"], ["muon"], ["lowrank"])


def test_importing_params_loads_no_registry():
    code = "import sys, lmgeo.params\nassert 'torch' not in sys.modules, 'torch'\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_scientific_notation_is_a_float(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("train:\n  adamw_lr: 1e-3\n")
    assert load_params(path).train.adamw_lr == pytest.approx(1e-3)


def test_yaml_syntax_error_is_reported(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("train: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(path)


def _lmgeo(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmgeo.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("train: {steps: -1}\n", "train.steps"),
        ("train:\n  steps: [\n", "not valid YAML"),
        ("analysis: {k: 100000}\n", "analysis.k"),
        ("trainn: {}\n", "unknown key 'trainn'"),
    ],
)
@pytest.mark.parametrize("stage", ["prepare", "train", "fit"])
@pytest.mark.slow  # lmgeo in a subprocess, 12 times
def test_cli_exits_2_before_any_work(tmp_path, content, needle, stage):
    (tmp_path / "params.yaml").write_text(content)
    done = _lmgeo([stage], tmp_path)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr
    assert done.stderr.count("lmgeo: error:") == 1
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "file not found"),
        ("- a list\n", "a preset must be a mapping of params sections"),
        ("trainn: {}\n", "overrides: unknown key 'trainn'"),
    ],
)
@pytest.mark.slow  # a fresh interpreter
def test_a_refused_preset_is_named_once(tmp_path, content, message):
    (tmp_path / "params.yaml").write_text("train: {steps: 5}\n")
    preset = tmp_path / "bad.yaml"
    if content is not None:
        preset.write_text(content)
    done = _lmgeo(["preset", str(preset)], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"lmgeo: error: {preset}: {message}"


@pytest.mark.slow  # a fresh interpreter
def test_help_does_not_import_torch_or_ray():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from lmgeo.cli import app\n"
        "runner = CliRunner()\n"
        "for args in [['--help']] + [[c, '--help'] for c in "
        "['prepare','train','extract','fit','perturb','aggregate','report','query','bench']]:\n"
        "    result = runner.invoke(app, args)\n"
        "    assert result.exit_code == 0, (args, result.output)\n"
        "heavy = [m for m in ('torch', 'ray', 'transformers', 'duckdb', 'pyarrow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_params_file_round_trips_through_yaml(tmp_path):
    params = load_params(REPO / "params.yaml")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    assert load_params(path) == params


def test_every_param_dvc_tracks_is_written_in_params_yaml():
    """DVC refuses to run a stage whose `params:` key is missing from params.yaml, even with a default."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for name, stage in stages.items():
        for dotted in stage.get("params", []):
            node = raw
            for part in dotted.split("."):
                assert isinstance(node, dict) and part in node, f"stage {name}: {dotted} not in params.yaml"
                node = node[part]


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "presets").glob("*.yaml")))
def test_every_preset_applies_to_the_default_params(preset):
    from lmgeo.core.config import flatten_overrides, load_yaml
    from lmgeo.params import apply_overrides

    params = apply_overrides(load_params(REPO / "params.yaml"), flatten_overrides(load_yaml(REPO / "presets" / preset)))
    assert params.train.runs()


def test_the_ablation_presets_set_what_they_say():
    from lmgeo.core.config import flatten_overrides, load_yaml
    from lmgeo.params import apply_overrides
    from lmgeo.study_b.recipes import RECIPES

    def preset(name):
        return apply_overrides(load_params(REPO / "params.yaml"), flatten_overrides(load_yaml(REPO / "presets" / name)))

    # the default study leaves the sweep to its preset: >= 3 budgets on >= 3 of the study's seeds at its horizon,
    # spanning the Hilbert recipes' tuned taus; the centred rows take rownorm's tuned row norm η
    default = load_params(REPO / "params.yaml").train
    assert default.matched_budget is None
    full = preset("sweep.yaml").train
    sweep = full.matched_budget
    assert len(sweep.taus) >= 3 and len(sweep.seeds) >= 3 and set(sweep.seeds) <= set(full.seeds)
    for recipe in ("hilbert", "hilbert_equi"):
        assert min(sweep.taus) < RECIPES[recipe].default_step.tau < max(sweep.taus)
    centring = preset("centring.yaml").train
    assert centring.recipe_overrides["hilbert"].head_lr == pytest.approx(2 * RECIPES["rownorm"].default_step.head_lr)


def test_a_preset_value_reads_back_through_dvcs_grammar():
    """`lmgeo preset` prints mappings with bare keys and no spaces (Hydra, which DVC's `-S` uses, takes no
    quoted key, and the shell splits `$(lmgeo preset ...)` on spaces); the value reads back unchanged."""
    from lmgeo.core.config import override_value, parse_override_value

    value = [{"id": "EleutherAI/pythia-70m", "revision": "step143000"}, {"id": "./models/x"}, {"n": 1.5e-6, "on": None}]
    printed = override_value(value)
    assert " " not in printed and '"id"' not in printed
    assert parse_override_value("analysis.external_models", printed) == value


def test_the_matched_budget_sweep_is_the_grid_again_per_seed_and_budget_and_study_as_own_runs_go_first():
    from lmgeo.core.contracts import parse_run_id
    from lmgeo.study_b.train import head_budget

    taus = [0.1, 0.2, 0.4, 0.8, 1.6]
    params = parse_params(
        {
            "train": {
                "archs": ["neox"],
                "recipes": ["muon", "hilbert"],
                "seeds": [0, 1, 2],
                "steps": 50,
                "matched_budget": {"taus": taus, "seeds": [1, 2]},
            },
            "analysis": {"runs": {"archs": ["mamba"], "recipes": ["muon"], "seeds": [0]}},
        }
    )
    specs = params.trained_runs()
    runs = [spec.run_id for spec in specs]
    assert runs[:7] == [
        "mamba-muon-s0",
        "neox-muon-s0",
        "neox-muon-s1",
        "neox-muon-s2",
        "neox-hilbert-s0",
        "neox-hilbert-s1",
        "neox-hilbert-s2",
    ]
    sweep = specs[7:]
    assert runs[7:9] == ["neox-muon-s1-cap0.1", "neox-muon-s1-cap0.2"]
    # every recipe x sweep seed x budget, each once, at the study's horizon (its own run is the reference)
    assert len(set(runs[7:])) == len(runs[7:]) == 2 * 2 * len(taus)
    assert {(s.recipe, s.seed, s.cap) for s in sweep} == {
        (r, seed, c) for r in ("muon", "hilbert") for seed in (1, 2) for c in taus
    }
    assert all(s.matched and params.train.for_run(s).steps == 50 for s in sweep)
    for spec in sweep:
        assert parse_run_id(spec.run_id) == spec
        assert head_budget(params.train.for_run(spec), spec) == spec.cap
    assert head_budget(params.train, parse_run_id("neox-muon-s1")) is None
    with pytest.raises(ValueError, match="lacks it"):
        head_budget(params.train, parse_run_id("neox-muon-s1-cap0.3"))
    assert not set(params.analysed_runs()) & set(sweep)  # Study A analyses the recipes as tuned


def test_the_sweep_trains_rownorm_once_as_hilbert_and_only_on_the_studys_seeds():
    """Under a matched budget `rownorm`'s training is `hilbert`'s (SPEC §3.2): with both in the grid the sweep
    trains `hilbert` only; alone, `rownorm` is swept. Sweep seeds outside the study's are refused (the study's
    run of the seed is the sweep's reference)."""
    both = parse_params(
        {
            "train": {
                "recipes": ["muon", "rownorm", "hilbert"],
                "seeds": [0],
                "matched_budget": {"taus": [0.4], "seeds": [0]},
            }
        }
    )
    assert both.train.swept_recipes() == ["muon", "hilbert"]
    assert not any(r.recipe == "rownorm" and r.matched for r in both.trained_runs())
    alone = parse_params(
        {"train": {"recipes": ["muon", "rownorm"], "seeds": [0], "matched_budget": {"taus": [0.4], "seeds": [0]}}}
    )
    assert alone.train.swept_recipes() == ["muon", "rownorm"]
    with pytest.raises(ParamsError, match=r"matched_budget.seeds \[3\] are not among train.seeds"):
        parse_params({"train": {"seeds": [0], "matched_budget": {"taus": [0.4], "seeds": [0, 3]}}})


@pytest.mark.parametrize("tau", [0.1, 1.6, 2.0, 1e-05, 3e-7, 12.5])
def test_a_budget_reads_back_from_its_run_id_without_an_exponent(tau: float) -> None:
    from lmgeo.core.contracts import parse_run_id, run_id

    run = run_id("neox", "hilbert_equi", 3, matched=True, cap=tau)
    assert "e" not in run.split("-cap")[1] and parse_run_id(run).cap == tau
    with pytest.raises(ValueError, match="and only such a run"):
        run_id("neox", "muon", 0, cap=tau)
    with pytest.raises(ValueError, match="has a budget"):
        run_id("neox", "muon", 0, matched=True)


def test_an_override_inside_a_null_section_creates_it():
    from lmgeo.params import Params, apply_overrides

    params = apply_overrides(Params(), {"train.matched_budget.taus": "[0.4]", "train.matched_budget.seeds": "[0]"})
    assert params.train.matched_budget.taus == [0.4] and params.train.matched_budget.seeds == [0]


def test_analysis_runs_null_analyses_no_trained_run_and_leaves_trainings_grid_alone():
    """`lmgeo analyse` sets `analysis.runs: null`: Study A then holds only the external models."""
    from lmgeo.params import apply_overrides

    default = load_params()
    none = apply_overrides(default, {"analysis.runs": "null"})
    assert none.analysis.runs is None and none.analysed_runs() == []
    assert none.trained_runs() == default.train.runs() and default.analysed_runs()


def test_the_packaged_default_study_is_params_yaml():
    """`lmgeo analyse` (from any folder) and `lmgeo findings` read the default study shipped with the package;
    the repository's params.yaml, which `dvc repro` runs, must be that same study."""
    from lmgeo.params import DEFAULT_STUDY, default_study

    assert default_study() == load_params(REPO / "params.yaml"), (
        f"params.yaml and {DEFAULT_STUDY.relative_to(REPO)} differ: change both together"
    )
    assert DEFAULT_STUDY.is_relative_to(REPO / "lmgeo")  # package data (pyproject's package-data lists it)
