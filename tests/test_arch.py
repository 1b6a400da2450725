"""The architecture table, model building (untied, seeded) and safe loading."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import SEQ_LEN, VOCAB, tiny_size
from safetensors.torch import load_file

from lmgeo.core.errors import InputError
from lmgeo.models.loading import ModelLoadError, load_model
from lmgeo.models.registry import (
    FAMILIES,
    UnsupportedArchitecture,
    blocks_of,
    build_model,
    family_of,
    final_norm_of,
    head_of,
)

TINY = tiny_size()


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _save(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_table_paths_name_the_blocks_final_norm_and_head(arch):
    model = build_model(arch, TINY, VOCAB, SEQ_LEN, seed=0).eval()
    assert family_of(model).name == arch
    assert len(blocks_of(model)) == TINY.n_layers
    assert head_of(model) is model.get_output_embeddings()
    assert head_of(model).weight.shape == (VOCAB, TINY.d_model)
    # the final norm is what turns the last block's output into the model's last hidden state
    seen = {}
    handles = [
        blocks_of(model)[-1].register_forward_hook(lambda m, a, o: seen.update(last_block=o)),
        final_norm_of(model).register_forward_hook(lambda m, a, o: seen.update(final_norm=o)),
    ]
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    for h in handles:
        h.remove()
    torch.testing.assert_close(seen["final_norm"], out.hidden_states[-1])
    torch.testing.assert_close(final_norm_of(model)(seen["last_block"]), out.hidden_states[-1])


def test_build_is_seeded_sized_and_leaves_the_global_rng_alone(arch):
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(arch, TINY, VOCAB, SEQ_LEN, seed=5)
    assert torch.equal(torch.rand(1), expected_next)
    assert _same_weights(a, build_model(arch, TINY, VOCAB, SEQ_LEN, seed=5))
    assert not _same_weights(a, build_model(arch, TINY, VOCAB, SEQ_LEN, seed=6))
    assert a.get_input_embeddings().weight.shape == (VOCAB, TINY.d_model)
    assert a.config.tie_word_embeddings is False


def _aten_ops(fn, x: torch.Tensor) -> list[str]:
    from torch.profiler import profile

    with profile() as prof:
        fn(x)
    return [e.name for e in prof.events() if e.name.startswith("aten::")]


def test_gpt2s_gelu_is_one_fused_op_computing_gelu_new_to_float_rounding():
    from transformers.activations import ACT2FN

    model = build_model("gpt2", TINY, VOCAB, SEQ_LEN, seed=0)
    fused, spelled_out = model.transformer.h[0].mlp.act, ACT2FN["gelu_new"]
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 4
    x64 = x.double()
    # GPT-2's formula, in float64: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    exact = 0.5 * x64 * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x64 + 0.044715 * x64**3)))
    scale = exact.abs().clamp_min(1.0)  # near zero crossings, compare absolutely
    fused_err = float(((fused(x).double() - exact).abs() / scale).max())
    spelled_err = float(((spelled_out(x).double() - exact).abs() / scale).max())
    assert fused_err < 1e-6 and spelled_err < 1e-6, (fused_err, spelled_err)  # float32: ε = 1.2e-7
    assert float(((fused(x) - spelled_out(x)).double().abs() / scale).max()) < 2e-6
    assert _aten_ops(fused, x) == ["aten::gelu"]
    assert len(_aten_ops(spelled_out, x)) >= 6  # pow, mul, add, mul, tanh, add, mul, mul


def test_head_is_untied_after_build_and_after_save_load(arch, tmp_path):
    model = build_model(arch, TINY, VOCAB, SEQ_LEN, seed=0)
    assert head_of(model).weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    loaded = load_model(str(_save(model, tmp_path / arch)))
    assert _same_weights(model, loaded)
    assert not loaded.training
    embedding = loaded.get_input_embeddings().weight.detach().clone()
    with torch.no_grad():
        head_of(loaded).weight.add_(1.0)
    assert torch.equal(loaded.get_input_embeddings().weight, embedding)


def test_neox_head_is_embed_out_on_disk_and_lm_head_in_memory(tmp_path):
    """Pythia checkpoints name the head `embed_out`; transformers 5 renames it to `lm_head` both ways."""
    model = build_model("neox", TINY, VOCAB, SEQ_LEN, seed=0)
    path = _save(model, tmp_path / "pythia")
    weights = load_file(path / "model.safetensors")
    assert torch.equal(weights["embed_out.weight"], head_of(model).weight)
    assert torch.equal(head_of(load_model(str(path))).weight, head_of(model).weight)


def test_unknown_families_are_named_with_what_is_supported():
    with pytest.raises(UnsupportedArchitecture, match="gpt_neox") as err:
        family_of(SimpleNamespace(config=SimpleNamespace(model_type="no_such_family")))
    assert "no_such_family" in str(err.value) and isinstance(err.value, InputError)
    with pytest.raises(InputError, match="unknown model family 'nope'; registered: " + ", ".join(FAMILIES.names())):
        build_model("nope", TINY, VOCAB, SEQ_LEN, seed=0)


def _config_only_dir(path: Path, **config) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_model_type_that_is_not_a_causal_lm_is_refused_before_reading_weights(tmp_path):
    """(A causal LM whose structure Study A cannot use, e.g. BERT's, is refused by structure resolution:
    tests/test_families.py.)"""
    path = _config_only_dir(tmp_path / "t5", model_type="t5")
    with pytest.raises(UnsupportedArchitecture, match="model_type 't5' is not a causal LM"):
        load_model(str(path))


def test_remote_code_is_refused_unless_trusted(tmp_path):
    model = build_model("gpt2", TINY, VOCAB, SEQ_LEN, seed=0)
    path = _save(model, tmp_path / "remote")
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="remote code"):
        load_model(str(path))


def test_pickle_only_weights_are_refused(tmp_path):
    model = build_model("gpt2", TINY, VOCAB, SEQ_LEN, seed=0)
    path = _save(model, tmp_path / "pickled")
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors only"):
        load_model(str(path))


def test_missing_or_incomplete_local_paths_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nowhere" / "model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
    path = _config_only_dir(tmp_path / "weightless", model_type="gpt2")
    with pytest.raises(ModelLoadError, match="no model weights"):
        load_model(str(path))


def test_paths_stay_inside_the_workspace_unless_allowed(tmp_path):
    workspace, outside = tmp_path / "ws", tmp_path / "elsewhere"
    workspace.mkdir()
    model = build_model("mamba", TINY, VOCAB, SEQ_LEN, seed=0)
    _save(model, workspace / "models" / "m")
    _save(model, outside)
    assert _same_weights(model, load_model("models/m", workspace=workspace))
    with pytest.raises(ModelLoadError, match="outside the workspace"):
        load_model(str(outside), workspace=workspace)
    with pytest.raises(ModelLoadError, match="outside the workspace"):
        load_model("../elsewhere", workspace=workspace)
    assert _same_weights(model, load_model(str(outside), workspace=workspace, allow_outside_paths=True))


# ------------------------------------------------------------------ refusals name the model's folder
def test_a_model_the_stages_refuse_is_named_by_its_path(tmp_path):
    """A config transformers cannot build or a structure Study A cannot use is refused by messages that do
    not name the model (they stay free of paths for `lmgeo families`' table); the stages name it."""
    from lmgeo.driver.analysis_set import model_source
    from lmgeo.driver.layout import Layout
    from lmgeo.models.structure import StructureError
    from lmgeo.params import Params

    layout, params = Layout(tmp_path), Params()
    (tmp_path / "models").mkdir()
    _config_only_dir(tmp_path / "models" / "bad", model_type="gpt2", n_embd=5, n_head=2, n_layer=1, vocab_size=VOCAB)
    _config_only_dir(
        tmp_path / "models" / "bert",
        model_type="bert-generation",
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        vocab_size=VOCAB,
    )
    (tmp_path / "models" / "file").write_text("not a folder")
    with pytest.raises(ModelLoadError, match="^models/bad: config.json does not describe a model"):
        model_source(layout, params, "models/bad", None)
    with pytest.raises(StructureError, match="^models/bert: no final norm"):
        model_source(layout, params, "models/bert", None)
    with pytest.raises(ModelLoadError, match=f"is not a directory \\(resolved to {tmp_path / 'models' / 'file'}\\)"):
        model_source(layout, params, "models/file", None)


def test_weights_changed_after_planning_and_a_missing_tokenizer_name_the_model_files(tmp_path):
    from lmgeo.core.store import ManifestKey, ShardWriter
    from lmgeo.driver.analysis_set import AnalysedModel, model_tokenizer
    from lmgeo.driver.layout import Layout
    from lmgeo.driver.opening import verify_weights
    from lmgeo.params import Params

    layout, params = Layout(tmp_path), Params()
    folder = _save(build_model("gpt2", TINY, VOCAB, SEQ_LEN, seed=0), tmp_path / "models" / "ext")
    external = AnalysedModel("./models/ext", "./models/ext", None, None, "digest-at-planning")
    with pytest.raises(
        InputError, match=f"^./models/ext \\({folder}\\): its files changed after the stage was planned"
    ):
        verify_weights(layout, params, external)
    # (transformers builds an empty tokenizer from a model folder without one, or fails to: either is refused)
    refused = "(no usable tokenizer beside the model|its tokenizer encodes text to no tokens)"
    with pytest.raises(InputError, match=f"^./models/ext \\({folder}\\): {refused}"):
        model_tokenizer(layout, params, external)

    with ShardWriter(layout.models, "run", ManifestKey({}, "p", "c")) as writer, writer.directory("run/final") as final:
        (final / "model.safetensors").write_bytes(b"weights")
    trained = AnalysedModel("run@final", str(layout.checkpoint("run", "final")), None, "run", "digest-at-planning")
    weights = layout.checkpoint("run", "final") / "model.safetensors"
    with pytest.raises(InputError, match=f"^run@final \\({weights}\\): retrained after the stage was planned"):
        verify_weights(layout, params, trained)
