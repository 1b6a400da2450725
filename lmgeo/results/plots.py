"""The series of DVC's data plots (`dvc plots show`, and `dvc plots diff` across revisions and experiments):
Study B's validation-loss curves and its matched-budget sweep, from the result tables, as small long-format
tables with an `arch` and a `recipe` column (`dvc.yaml` draws a line per recipe and a panel per architecture:
`.dvc/plots/lines_by_recipe.json`). Means over seeds are taken in a fixed order, so the same tables give the
same bytes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from math import fsum

import pyarrow as pa

# file stem -> what its series is (dvc.yaml's plot of that file draws it)
SERIES = {
    "val_loss": "validation loss at each evaluation step, mean over seeds, of the comparison's runs",
    "loss_vs_budget": "the matched-budget sweep: test (and validation) loss at each head budget tau, mean over seeds",
}


def plot_series(tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """The `SERIES`, from the `runs`, `curves` and `recipes` tables (empty when Study B did not run)."""
    runs = {r["run"]: r for r in tables["runs"].to_pylist()} if "runs" in tables else {}
    curves = tables["curves"].to_pylist() if "curves" in tables else []
    by_step: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for row in curves:
        run = runs.get(row["run"])
        if run is not None and not run["matched"] and row["val_loss"] is not None:
            by_step[run["arch"], run["recipe"], row["step"]].append(row["val_loss"])
    val_loss = [
        {"arch": arch, "recipe": recipe, "step": step, "val_loss": _mean(values)}
        for (arch, recipe, step), values in sorted(by_step.items())
    ]
    recipes = tables["recipes"].to_pylist() if "recipes" in tables else []
    swept = sorted(
        (r for r in recipes if r["matched"] and r["head_budget_tau"] is not None),
        key=lambda r: (r["arch"], r["recipe"], r["head_budget_tau"]),
    )
    budget = [
        {key: r[key] for key in ("arch", "recipe", "head_budget_tau", "test_loss_mean", "val_loss_mean")} for r in swept
    ]
    return {
        "val_loss": _table(
            val_loss, [("arch", pa.string()), ("recipe", pa.string()), ("step", pa.int64()), ("val_loss", pa.float64())]
        ),
        "loss_vs_budget": _table(
            budget,
            [
                ("arch", pa.string()),
                ("recipe", pa.string()),
                ("head_budget_tau", pa.float64()),
                ("test_loss_mean", pa.float64()),
                ("val_loss_mean", pa.float64()),
            ],
        ),
    }


def _mean(values: Iterable[float]) -> float:
    ordered = sorted(values)  # the runs' order must not decide the last bits
    return fsum(ordered) / len(ordered)


def _table(rows: list[dict], fields: list[tuple[str, pa.DataType]]) -> pa.Table:
    schema = pa.schema(fields)
    return pa.Table.from_pylist(rows, schema=schema) if rows else schema.empty_table()
