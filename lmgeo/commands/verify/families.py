"""Coverage of the causal-LM families transformers ships (`lmgeo families`, `docs/families.md`).

For every model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: a tiny random-weight config (a generic
shrinker plus a few per-family fixes), saved with `save_pretrained` and opened through the pipeline's own
loading path (strict, safetensors), then verified (`lmgeo.study_a.verify`), extracted and patched. A
family is *verified* when all of that holds, *refused* with the reason otherwise: the check that failed,
or what could not be built. Nothing is downloaded: every model is built from transformers' own config
classes.
"""

from __future__ import annotations

import contextlib
import re
import signal
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The tiny size every family is shrunk to. Four blocks: three chaining boundaries, and room for a hybrid's
# two kinds of block. Widths keep every head count and group size integral.
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}
# Other size keys some families use, and the tiny value for each (set only where the family has the key).
TINY_EXTRA = {
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 8,
    "state_size": 8,
    "d_state": 8,
    "mamba_d_state": 8,
    "conv_kernel": 4,
    "time_step_rank": 8,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "chunk_size": 8,
    "embedding_size": 64,
    "word_embed_proj_dim": 64,
    "rotary_dim": 8,
    "partial_rotary_factor": 0.5,
    "d_head": 16,
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 16,
    # encoder-decoder families' causal-LM decoders
    "encoder_layers": 4,
    "decoder_layers": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
}
# Logit maps families document (`lmgeo.models.structure`), set away from the identity where a family has
# the key, so that the readout check sees them applied.
LOGIT_MAPS = {
    "final_logit_softcapping": 5.0,
    "logits_soft_cap": 5.0,
    "output_logit_soft_cap": 5.0,
    "logit_scale": 0.5,
    "logits_scaling": 4.0,
    "lm_head_multiplier": 0.5,
}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
PROBE_SEQUENCES, PROBE_LENGTH = 2, 16
FAMILY_TIMEOUT_S = 120

# Families the generic shrinker cannot size alone: the keys they need on top of it.
FAMILY_FIXES: dict[str, dict[str, Any]] = {
    "mamba2": {"num_heads": 8},  # its heads must tile hidden_size × expand
    "dots3_note": {"num_key_value_heads": 4},  # no grouped-query attention
    "dots3_note_text": {"num_key_value_heads": 4},
    "zaya": {"num_experts_per_tok": 1},  # routes to one expert only
}

# The fixed list the test suite runs (the full coverage is `lmgeo families`): the families researchers
# study most, and MoE and hybrid families that pass.
CI_FAMILIES = (
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
)


@dataclass(frozen=True)
class Coverage:
    model_type: str
    verified: bool
    detail: str  # the structure when verified; the message of what failed when refused
    cause: str = ""  # refused: the verification check, or the step, that failed

    @property
    def fixes(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in FAMILY_FIXES.get(self.model_type, {}).items())


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# ------------------------------------------------------------------------------------------ shrinking
def tiny_config(model_type: str, base=None):
    """A tiny config of `model_type`: the family's defaults (or the settings of `base`, a config of that
    family, e.g. a published model's) with every size key it has shrunk (in its nested configs too), then
    the family's fixes."""
    from transformers import AutoConfig

    default = base if base is not None else AutoConfig.for_model(model_type)
    kept = (
        {k: v for k, v in base.to_dict().items() if k not in ("model_type", "transformers_version")}
        if base is not None
        else {}
    )
    settings = kept | _shrunk(default)
    for name in _sub_config_names(default):
        nested = getattr(default, name)
        settings[name] = nested.to_dict() | _shrunk(nested)
    settings |= FAMILY_FIXES.get(model_type, {})
    return AutoConfig.for_model(model_type, **settings)


def _sub_config_names(config) -> list[str]:
    from transformers import PretrainedConfig

    return [name for name, value in vars(config).items() if isinstance(value, PretrainedConfig)]


def _shrunk(config) -> dict[str, Any]:
    """The tiny value of every size key `config` has (per layer where the family gives one per layer),
    other per-layer lists and layer patterns cut to the tiny depth, token ids moved inside the tiny
    vocabulary, documented logit maps made non-trivial so that the readout check exercises them."""
    values = config.to_dict()
    aliases = getattr(config, "attribute_map", {}) or {}
    depth = values.get("num_hidden_layers", values.get(aliases.get("num_hidden_layers", ""), None))
    tiny_depth = TINY["num_hidden_layers"]

    def per_layer(value: Any) -> bool:
        return isinstance(value, list) and bool(depth) and len(value) == depth

    settings: dict[str, Any] = {}
    for key, value in values.items():
        if per_layer(value) or (isinstance(value, str) and "pattern" in key and len(value) == depth):
            settings[key] = value[:tiny_depth]
    for key, tiny in (TINY | TINY_EXTRA | LOGIT_MAPS).items():
        if key in values or key in aliases:
            settings[key] = [tiny] * tiny_depth if per_layer(values.get(key)) else tiny
    if "qk_rope_head_dim" in values:  # multi-head latent attention: rotary on the rope part only
        rope, nope = TINY_EXTRA["qk_rope_head_dim"], TINY_EXTRA["qk_nope_head_dim"]
        settings |= {"head_dim": rope, "qk_head_dim": rope + nope}
    for key, value in TOKEN_IDS.items():
        if values.get(key) is not None:
            settings[key] = value
    return settings


# ------------------------------------------------------------------------------------------ checking
@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    def expire(_signum: int, _frame: Any) -> None:
        raise TimeoutError(f"took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check_family(model_type: str, workdir: Path, seed: int = 0) -> Coverage:
    """Build, save, load, verify, extract and patch a tiny `model_type`; the first step that fails is
    the reason it is refused."""
    from lmgeo.models.loading import load_model
    from lmgeo.models.structure import StructureError
    from lmgeo.study_a.verify import VerificationFailed, verify_model

    step = "tiny config"
    try:
        with _deadline(FAMILY_TIMEOUT_S), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = tiny_config(model_type)
            step = "build"
            path = save_tiny_model(config, workdir / model_type, seed)
            step = "load"
            model = load_model(str(path), max_parameters=10**8)
            step = "verify"
            verified = verify_model(model)
            step = "extract"
            states = extract_and_check(model, verified.n_blocks, verified.width)
            step = "patch"
            suffix = patch_and_check(model, states)
    except VerificationFailed as err:
        return Coverage(model_type, False, _one_line(err), f"check: {err.check}")
    except StructureError as err:
        return Coverage(model_type, False, _one_line(err), "structure")
    except Exception as err:  # noqa: BLE001 - every failure is a row of the table, named by its step
        return Coverage(model_type, False, _one_line(err), step)
    return Coverage(model_type, True, f"{verified.structure.describe()}; suffix patching {suffix}")


def _one_line(err: Exception) -> str:
    """The message on one line, without paths of the temporary folder (so the table is reproducible)."""
    text = re.sub(r"\S*lmgeo-families-\w+/", "", " ".join(str(err).split()))
    return f"{type(err).__name__}: {text[:240]}{'…' if len(text) > 240 else ''}"


def save_tiny_model(config, path: Path, seed: int) -> Path:
    """A random-weight model of `config` (seeded), saved with `save_pretrained` (safetensors)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def probe_tokens(model, seed: int = 1) -> np.ndarray:
    from lmgeo.models.registry import head_of

    vocab = min(model.get_input_embeddings().num_embeddings, head_of(model).out_features)
    return np.random.default_rng(seed).integers(0, vocab, size=(PROBE_SEQUENCES, PROBE_LENGTH))


def extract_and_check(model, n_blocks: int, width: int) -> list[np.ndarray]:
    """Extraction's rows for every layer 0..L, as (n_seq, seq_len, d) arrays."""
    from lmgeo.core.contracts import arrow_to_vectors
    from lmgeo.study_a.extract import extract_batches

    tokens = probe_tokens(model)
    per_layer: dict[int, list[np.ndarray]] = {}
    for layer, batch in extract_batches(model, tokens, np.arange(len(tokens)), batch_size=1):
        per_layer.setdefault(layer, []).append(arrow_to_vectors(batch.column("h")).reshape(1, PROBE_LENGTH, -1))
    if sorted(per_layer) != list(range(n_blocks + 1)):
        raise AssertionError(f"extraction wrote layers {sorted(per_layer)}, not 0..{n_blocks}")
    states = [np.concatenate(per_layer[layer]) for layer in range(n_blocks + 1)]
    if states[0].shape[-1] != width or not all(np.isfinite(s).all() for s in states):
        raise AssertionError("extracted states are not finite vectors of the model's width")
    return states


def patch_and_check(model, states: list[np.ndarray]) -> str:
    """Patch every layer at a few tokens: the true block output leaves the distribution unchanged (KL at
    rounding level); another vector gives a finite KL, the same whether the patched copy recomputes only
    the suffix of blocks (what the perturb stage runs) or the full forward. Returns how the suffix ran
    (`cached` or `recompute`, `lmgeo.study_a.patching.suffix_path`), over the layers."""
    from lmgeo.study_a.patching import patch_kl_anchors, suffix_path

    tokens = probe_tokens(model)
    rows, positions = np.array([0, 1, 0]), np.array([0, PROBE_LENGTH // 2, PROBE_LENGTH - 1])
    rng = np.random.default_rng(2)
    for layer in range(len(states) - 1):
        true = states[layer + 1][rows, positions]
        kl, kl_seq = patch_kl_anchors(model, tokens, rows, positions, layer, true, batch_size=2)
        if not (np.all(kl < 1e-6) and np.all(kl_seq < 1e-6)):
            raise AssertionError(
                f"layer {layer}: patching the true output changed the distribution (KL {kl.max():.3g})"
            )
        moved = true + rng.normal(0, 1, true.shape).astype(np.float32) * np.abs(true).mean()
        kl, kl_seq = patch_kl_anchors(model, tokens, rows, positions, layer, moved, batch_size=2)
        if not (np.isfinite(kl).all() and np.isfinite(kl_seq).all()):
            raise AssertionError(f"layer {layer}: a patch gave a non-finite KL")
        full = patch_kl_anchors(model, tokens, rows, positions, layer, moved, batch_size=2, mode="full")
        for got, want in zip((kl, kl_seq), full, strict=True):
            if not np.allclose(got, want, rtol=1e-3, atol=1e-6):
                raise AssertionError(f"layer {layer}: suffix patching gave KLs {got}, the full forward {want}")
    paths = set()
    for layer in range(len(states) - 1):
        path = suffix_path(model, layer)
        assert path is not None  # suffix patched every layer above
        paths.add(path[0])
    return "/".join(sorted(paths))


def coverage(model_types: list[str]) -> list[Coverage]:
    with tempfile.TemporaryDirectory(prefix="lmgeo-families-") as workdir:
        return [check_family(t, Path(workdir)) for t in model_types]


# ------------------------------------------------------------------------------------------ the table
def render_markdown(rows: list[Coverage], command: str, versions: dict[str, str]) -> str:
    from lmgeo.models.registry import FAMILIES

    trainable = ", ".join(f"`{f.model_type}`" for f in FAMILIES if f.trainable)
    verified = [r for r in rows if r.verified]
    refused = [r for r in rows if not r.verified]
    causes: dict[str, list[str]] = {}
    for row in refused:
        causes.setdefault(row.cause, []).append(row.model_type)
    lines = [
        "# Causal-LM families: what Study A verifies",
        "",
        f"Generated by `{command}` with transformers {versions.get('transformers')} and torch "
        f"{versions.get('torch')}; do not edit by hand. Every model type of transformers' "
        "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built tiny from its own config class (random weights; "
        f"{TINY['num_hidden_layers']} blocks, width {TINY['hidden_size']}, vocabulary {TINY['vocab_size']}), "
        "saved with `save_pretrained`, opened through lmgeo's loading path (strict, safetensors), verified "
        "(`lmgeo/study_a/verify.py`: blocks, chaining, last state, readout, extraction, patching), extracted "
        "and patched. *Verified* means all of that held; *refused* names the first thing that failed.",
        "",
        f"**{len(verified)} verified, {len(refused)} refused** of {len(rows)} model types.",
        "",
        "Refused, by cause:",
        "",
        *(
            f"- {cause} ({len(types)}): {', '.join(types)}"
            for cause, types in sorted(causes.items(), key=lambda c: -len(c[1]))
        ),
        "",
        "A *tiny config* or *build* failure is the shrinker's limit, not a verdict on the family: check a real "
        "checkpoint with `lmgeo check-model PATH_OR_ID`.",
        "",
        f"Training (Study B) is limited to the registered families, whose head is a plain linear map: {trainable}.",
        "",
        "| model type | result | structure (verified) or reason (refused) | tiny-config fixes |",
        "|---|---|---|---|",
    ]
    for row in rows:
        result = "verified" if row.verified else f"refused ({row.cause})"
        lines.append(f"| `{row.model_type}` | {result} | {row.detail.replace('|', '/')} | {row.fixes} |")
    return "\n".join(lines) + "\n"
