"""Study A on any causal-LM family (SPEC §1, §4.1): structure resolution, verification (every check can
fail, and names itself), the coverage of transformers' families, `lmgeo check-model`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from lmgeo.commands.verify.families import (
    CI_FAMILIES,
    Coverage,
    check_family,
    render_markdown,
    save_tiny_model,
    tiny_config,
)
from lmgeo.models.loading import load_model
from lmgeo.models.registry import final_norm_of, head_of, logits_from_last_state, structure_of
from lmgeo.models.structure import LogitMap, StructureError
from lmgeo.study_a import verify
from lmgeo.study_a.verify import VerificationFailed, verify_model

# The families issue 13 names; the CI list may hold more, never fewer.
REQUIRED = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi",
    "phi3",
    "olmo",
    "olmo2",
    "gpt2",
    "gpt_neo",
    "gpt_neox",
    "gptj",
    "falcon",
    "bloom",
    "opt",
    "stablelm",
    "starcoder2",
    "mamba",
    "mamba2",
    "falcon_mamba",
}
# Families whose state at a position exists only by running the prefix: their patched copies recompute it.
RECURRENT = {"mamba", "mamba2", "falcon_mamba"}


def tiny(model_type: str, seed: int = 0, **changes):
    """A tiny random-weight model of `model_type` (the coverage's shrinker), in eval mode."""
    config = tiny_config(model_type)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------ coverage
def test_the_ci_list_holds_every_family_the_issue_names():
    assert REQUIRED <= set(CI_FAMILIES) and len(CI_FAMILIES) >= 20


@pytest.mark.parametrize("model_type", CI_FAMILIES)
@pytest.mark.slow  # end to end for each family
def test_family_is_saved_loaded_verified_extracted_and_patched(model_type, tmp_path):
    """Saved with save_pretrained and opened through lmgeo's strict loading: mamba2 (like the hybrids)
    saves an infinite `time_step_limit` as {"__float__": "Infinity"}, which only transformers' reader decodes.
    Patching checks the suffix against the full forward; every attention family skips the prefix through
    its key/value cache."""
    row = check_family(model_type, tmp_path)
    assert row.verified, row.detail
    assert row.detail.endswith(f"suffix patching {'stepped' if model_type in RECURRENT else 'cached'}"), row.detail


def test_the_table_counts_and_groups_what_it_found():
    rows = [
        Coverage("a", True, "blocks x"),
        Coverage("b", False, "StructureError: no final norm", "structure"),
        Coverage("c", False, "VerificationFailed: readout", "check: readout"),
        Coverage("d", False, "StructureError: no final norm", "structure"),
    ]
    table = render_markdown(rows, "lmgeo families", {"transformers": "5", "torch": "2"})
    assert "**1 verified, 3 refused** of 4 model types." in table
    assert "- structure (2): b, d" in table and "- check: readout (1): c" in table
    assert "| `c` | refused (check: readout) | VerificationFailed: readout |" in table


# ------------------------------------------------------------------------------------------ resolution
def test_a_config_declaring_other_blocks_than_the_model_has_is_refused():
    model = tiny("llama")
    model.config.num_hidden_layers = 7
    with pytest.raises(StructureError, match="no list of 7 blocks"):
        structure_of(model)


def test_post_norm_encoders_are_refused_before_any_weight_is_read(tmp_path):
    """BERT's causal-LM head has no final norm after its blocks: refused from the config alone."""
    tiny_config("bert").save_pretrained(tmp_path)
    with pytest.raises(StructureError, match="no final norm beside the blocks bert.encoder.layer"):
        load_model(str(tmp_path))


def test_soft_cap_and_scale_match_their_formulas():
    z = torch.linspace(-40, 40, 17, dtype=torch.float64)
    expected = 5.0 * np.tanh(0.5 * z.numpy() / 5.0)
    np.testing.assert_allclose(LogitMap(scale=0.5, softcap=5.0)(z).numpy(), expected, rtol=1e-12)
    assert torch.equal(LogitMap()(z), z)


@pytest.mark.parametrize("model_type, key", [("gemma2", "softcap"), ("cohere", "scale"), ("granite", "scale")])
def test_documented_logit_maps_are_read_and_needed(model_type, key):
    """Final norm + head + the family's map reproduce the logits, and without the map they do not."""
    model = tiny(model_type)
    logit_map = structure_of(model).logit_map
    assert logit_map != LogitMap() and getattr(logit_map, key) not in (None, 1.0)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    captured = {}
    handle = final_norm_of(model).register_forward_pre_hook(lambda _m, args: captured.update(h=args[0]))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
        handle.remove()
        torch.testing.assert_close(logits_from_last_state(model, captured["h"]), logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(head_of(model)(final_norm_of(model)(captured["h"])), logits, atol=1e-3)


# ------------------------------------------------------------------------------------------ verification
def test_a_sound_model_passes_every_check():
    result = verify_model(tiny("llama"))
    assert result.n_blocks == 4 and result.width == 64
    assert set(result.max_error) == set(verify.CHECKS) - {"blocks"}
    assert all(error <= 1e-5 for error in result.max_error.values())


def _refused(model, check: str) -> None:
    with pytest.raises(VerificationFailed, match=f"verification failed: {check}:") as err:
        verify_model(model)
    assert err.value.check == check


def test_a_block_that_runs_another_fails_the_blocks_check(monkeypatch):
    model = tiny("llama")
    layers = model.model.layers
    own = layers[1].forward
    monkeypatch.setattr(layers[1], "forward", lambda *a, **kw: own(layers[0](*a, **kw), *a[1:], **kw))
    _refused(model, "blocks")


def test_a_change_between_blocks_fails_the_chaining_check():
    model = tiny("llama")
    model.model.layers[2].register_forward_pre_hook(lambda _m, args: (2 * args[0], *args[1:]))
    _refused(model, "chaining")


def test_a_change_before_the_final_norm_fails_the_last_state_check():
    model = tiny("llama")
    model.model.norm.register_forward_pre_hook(lambda _m, args: (args[0] + 1, *args[1:]))
    _refused(model, "last state")


def test_a_logit_map_the_model_does_not_apply_fails_the_readout_check():
    _refused(tiny("llama", logit_scale=2.0), "readout")  # Llama ignores a Cohere key


def test_an_extraction_of_normed_states_fails_the_extraction_check(monkeypatch):
    """The classic mistake: transformers' last hidden state has the final norm applied."""

    def hidden_states(model, ids):
        return list(model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states)

    monkeypatch.setattr(verify, "capture_states", hidden_states)
    _refused(tiny("gpt2"), "extraction")


def test_a_patch_that_does_not_reach_the_next_block_fails_the_patching_check():
    model = tiny("llama")
    first: list[torch.Tensor] = []

    def replay_first_input(_m, args):
        first.append(args[0]) if not first else None
        return (first[0], *args[1:])

    model.model.layers[1].register_forward_pre_hook(replay_first_input)
    _refused(model, "patching")


# ------------------------------------------------------------------------------------------ the command
def test_check_model_reports_a_verified_model_and_names_the_failed_check(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from lmgeo.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")
    save_tiny_model(tiny_config("qwen3"), tmp_path / "models" / "good", seed=0)
    save_tiny_model(tiny_config("qwen3"), tmp_path / "models" / "bad", seed=0)
    config = json.loads((tmp_path / "models" / "bad" / "config.json").read_text())
    (tmp_path / "models" / "bad" / "config.json").write_text(json.dumps({**config, "logit_scale": 3.0}))
    runner = CliRunner()
    good = runner.invoke(app, ["check-model", "./models/good"])
    assert good.exit_code == 0 and "verified" in good.output and "blocks model.layers" in good.output, good.output
    bad = runner.invoke(app, ["check-model", "./models/bad"])
    assert bad.exit_code == 2 and "lmgeo: error: verification failed: readout" in bad.output, bad.output


# ------------------------------------------------------------------------------------------ the seed's models
def test_the_seed_preset_analyses_the_rehearsed_models():
    """presets/seed.yaml's hub ids are those `lmgeo rehearse` extrapolates (docs/scale.md)."""
    from pathlib import Path

    import yaml

    from lmgeo.commands.rehearse.rehearsal import SEED_STUDY

    preset = yaml.safe_load((Path(__file__).parents[1] / "presets" / "seed.yaml").read_text())
    assert [m["id"] for m in preset["analysis"]["external_models"]] == list(SEED_STUDY)


@pytest.mark.parametrize("hub_id", ["EleutherAI/pythia-1.4b", "state-spaces/mamba-370m-hf", "distilbert/distilgpt2"])
@pytest.mark.slow  # saved, then opened by the stages
def test_a_seed_model_saved_locally_opens_as_the_stages_open_it(hub_id, tmp_path):
    """The seed's configurations (their published settings, shrunk to a tiny size), saved with
    save_pretrained inside the workspace, go through the stages' loading path (`external_model`:
    the safety checks and digest; `open_model`: load and verify), then extraction and patching."""
    from lmgeo.commands.rehearse.rehearsal import SEED_STUDY
    from lmgeo.commands.verify.families import extract_and_check, patch_and_check
    from lmgeo.driver.analysis_set import external_model
    from lmgeo.driver.layout import Layout
    from lmgeo.driver.opening import model_input, open_model
    from lmgeo.params import Params

    published = SEED_STUDY[hub_id][0]()
    config = tiny_config(published.model_type, base=published)
    assert config.tie_word_embeddings == published.tie_word_embeddings
    save_tiny_model(config, tmp_path / "models" / hub_id.split("/")[1], seed=0)
    layout, params = Layout(tmp_path), Params()
    model = external_model(params, layout, f"./models/{hub_id.split('/')[1]}", None)
    net, _device = open_model(params, model, model_input(layout, params, model).read())  # as a task gets it
    states = extract_and_check(net, config.num_hidden_layers, config.hidden_size)
    patch_and_check(net, states)


def test_the_readme_states_the_committed_coverage():
    """docs/models.md's and the README's coverage figures are those of the committed `docs/families.md`
    (regenerating the table without updating them fails here)."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    table = (repo / "docs" / "families.md").read_text()
    verified, total = re.search(r"\*\*(\d+) verified, \d+ refused\*\* of (\d+) model types", table).groups()
    cached, stepped, recompute = (table.count(f"suffix patching {path}") for path in ("cached", "stepped", "recompute"))
    assert f"{verified} families of transformers pass it" in " ".join((repo / "README.md").read_text().split())
    readme = " ".join((repo / "docs" / "models.md").read_text().split())
    assert f"{verified} of {total} verified" in readme
    assert f"(`cached`, {cached})" in readme and f"(`stepped`, {stepped}:" in readme
    assert f"(`recompute`, {recompute}:" in readme
