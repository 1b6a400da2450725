"""Short CPU trainings under the kernel pins every stage runs with (`lmgeo.core.determinism`): each run's
per-step training losses, final val and test losses and a digest of its final weights, printed as JSON.

`tests/test_pinned_training.py` runs this in a fresh process (the pins take effect only before torch loads)
and compares the output with the values the starting code of issue #39 produced, so a change meant to be
bit-neutral on the CPU path (the fused CUDA step, the batched Newton–Schulz, the radius kept as a tensor)
is shown to be exactly that. Explicit step sizes and schedules keep the runs independent of the recipes'
tuned defaults.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np


def runs() -> dict[str, tuple[str, str, dict]]:
    """name -> (arch, recipe, TrainConfig overrides)."""
    steps = {
        "adamw": {"head_lr": 0.01},
        "muon": {"head_lr": 0.03},
        "muon_head": {"head_lr": 0.03},
        "sign": {"head_lr": 0.4},
        "rownorm": {"head_lr": 0.03},
        "hilbert": {"tau": 0.4},
    }
    found = {f"neox-{r}": ("neox", r, {"recipe_overrides": {r: step}}) for r, step in steps.items()}
    found["neox-hilbert-decay"] = (
        "neox",
        "hilbert",
        {"recipe_overrides": {"hilbert": steps["hilbert"]}, "weight_decay": 0.1},
    )
    found["mamba-muon"] = ("mamba", "muon", {"recipe_overrides": {"muon": steps["muon"]}})
    found["gpt2-muon"] = ("gpt2", "muon", {"recipe_overrides": {"muon": steps["muon"]}})
    return found


def train(arch: str, recipe: str, overrides: dict) -> dict:
    import torch

    from lmgeo.core.contracts import RunSpec
    from lmgeo.models.config import ModelSize
    from lmgeo.study_b.config import RecipeConfig, Schedule, TrainConfig
    from lmgeo.study_b.train import train_run

    vocab, seq_len = 128, 16
    rng = np.random.default_rng(0)
    tokens = {
        split: rng.integers(0, vocab, n).astype(np.int32) for split, n in (("train", 6000), ("val", 900), ("test", 900))
    }
    overrides = dict(overrides)
    overrides["recipe_overrides"] = {r: RecipeConfig(**s) for r, s in overrides["recipe_overrides"].items()}
    cfg = TrainConfig(
        model=ModelSize(d_model=32, n_layers=2, n_heads=4, d_state=8, expand=2),
        steps=8,
        batch_size=4,
        eval_interval=4,
        eval_batches=1,
        test_batches=2,
        probe_sequences=2,
        geometry_interval=4,
        equi_sample_rows=32,
        device="cpu",
        schedule=Schedule(warmup_steps=2),
        **overrides,
    )
    weights = {}

    def keep_final(model: torch.nn.Module, name: str, info: dict) -> None:
        if name == "final":
            digest = hashlib.sha256()
            for key, tensor in sorted(model.state_dict().items()):
                digest.update(key.encode())
                digest.update(tensor.detach().contiguous().numpy().tobytes())
            weights["sha256"] = digest.hexdigest()

    record, steps = train_run(
        RunSpec(arch, recipe, 0),
        cfg,
        tokens["train"],
        tokens["val"],
        vocab,
        seq_len,
        "pin",
        keep_final,
        test_tokens=tokens["test"],
    )
    return {
        "train_loss": [repr(v) for v in steps.column("train_loss").to_pylist()],
        "final_val_loss": repr(record.final_val_loss),
        "final_test_loss": repr(record.final_test_loss),
        "weights_sha256": weights["sha256"],
    }


def main() -> None:
    from lmgeo.core.determinism import pin_torch

    pin_torch(1)
    names = sys.argv[1:] or list(runs())
    print(json.dumps({name: train(*runs()[name]) for name in names}, indent=1))


if __name__ == "__main__":
    main()
