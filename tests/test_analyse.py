"""`lmgeo analyse MODEL_DIR`: Study A on one local model folder of a verified family that lmgeo does not train
(Llama), end to end in a subprocess — the README's command as written — and each bad input refused before any
stage runs."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from reliability_helpers import lmgeo, preset_overrides, write_params
from test_e2e import readme_commands
from test_integrity import fails

from pipeline.core.errors import InputError
from pipeline.params import apply_overrides, load_params
from tools.families import save_tiny_model, tiny_config

pytestmark = pytest.mark.slow  # starts lmgeo, Ray and the stages

REPO = Path(__file__).resolve().parents[1]
# The tiny preset's analysis (k = 40 identifies the local classes up to the width 32 of the model below).
TINY = {**preset_overrides("tiny"), "analysis.checkpoints": '["final"]'}
SAMPLE = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 20


def tokenizer(vocab_size: int = 300):
    """A byte-level BPE trained on a few lines, as a `PreTrainedTokenizerFast` a model folder holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator([SAMPLE], trainer=trainer)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")


def save_model(path: Path, model_type: str = "llama", width: int = 32, with_tokenizer: bool = True) -> Path:
    tok = tokenizer()
    config = tiny_config(model_type)
    for key, value in {"hidden_size": width, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "num_key_value_heads": 1, "head_dim": 16, "vocab_size": len(tok)}.items():  # fmt: skip
        if hasattr(config, key):
            setattr(config, key, value)
    save_tiny_model(config, path, seed=0)
    if with_tokenizer:
        tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def analysed(tmp_path_factory) -> tuple[Path, str]:
    """The README's `lmgeo analyse` line as written, on a tiny Llama saved where it says (the tiny preset's
    analysis in the folder's params.yaml)."""
    (line,) = readme_commands("lmgeo analyse")
    command, subcommand, model, option, out = shlex.split(line)
    assert (command, subcommand, option) == ("lmgeo", "analyse", "--out"), line
    root = tmp_path_factory.mktemp("analyse")
    save_model(root / model)
    write_params(root, TINY)
    done = lmgeo(root, subcommand, model, option, out)
    return root / out, done.stdout


def test_analyse_runs_study_a_on_a_llama_folder_and_writes_its_own_report(analysed):
    out, stdout = analysed
    assert "analyse: [1/5] prepare" in stdout and "analyse: [5/5] tables and report" in stdout, stdout
    text = (out / "report.md").read_text()
    assert "## Study A: layer-update geometry" in text and "my-model" in text
    assert "Study B" not in text  # one model, Study A only
    assert "trained" not in text.replace("untrained", "")  # an external model: no "trained" and no init row
    assert (out / "report.html").is_file() and list((out / "figures").glob("*.png"))
    assert not (out / "data" / "models").exists()  # nothing was trained


def test_the_analysis_is_queryable_in_its_workspace(analysed):
    out, _ = analysed
    done = lmgeo(out, "query", "SELECT DISTINCT model FROM geometry", "--format", "csv")
    models = done.stdout.splitlines()[1:]
    assert len(models) == 1 and models[0].endswith("my-model"), done.stdout


def test_a_folder_that_is_not_a_model_is_one_error_line(tmp_path):
    (tmp_path / "empty").mkdir()
    write_params(tmp_path, TINY)
    fails(lmgeo(tmp_path, "analyse", "empty", check=False), "config.json")
    assert not (tmp_path / "analyse-empty" / "data").exists()


def _refusal(tmp_path: Path, model: Path, **overrides: str) -> str:
    """The refusal of `tools.analyse.run`, in process (no stage may have started: no data written)."""
    from tools.analyse import run

    params = apply_overrides(load_params(REPO / "params.yaml"), {**TINY, **overrides})
    with pytest.raises(InputError) as refused:
        run(params, model_dir=model, out=tmp_path / "out")
    assert not (tmp_path / "out" / "data").exists()
    return str(refused.value)


def test_an_unverified_family_is_refused_before_extraction(tmp_path):
    message = _refusal(tmp_path, save_model(tmp_path / "gpt1", model_type="openai-gpt"))
    assert "no final norm" in message, message


def test_a_model_without_its_tokenizer_is_refused(tmp_path):
    message = _refusal(tmp_path, save_model(tmp_path / "bare", with_tokenizer=False))
    assert "tokenizer" in message, message


def test_a_model_too_wide_for_k_is_refused_before_extraction(tmp_path):
    message = _refusal(tmp_path, save_model(tmp_path / "wide", width=64), **{"analysis.k": "20"})
    assert "analysis.k (20)" in message and "d = 64" in message, message
