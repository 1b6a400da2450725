"""The registered head-optimizer recipes of Study B, in the order of SPEC §3.2 (baselines first): one module
each, named as the recipe. An index only: a shard's code version holds the recipes it runs (SPEC §1), so this
file holds nothing but the list."""

from lmgeo.core.registry import Registry
from lmgeo.study_b.recipes import adamw, hilbert, hilbert_ctl, hilbert_equi, muon, muon_head, rownorm, sign
from lmgeo.study_b.recipes.base import HeadRecipe

RECIPES: Registry[HeadRecipe] = Registry(
    "recipe",
    [
        adamw.RECIPE,
        muon.RECIPE,
        muon_head.RECIPE,
        sign.RECIPE,
        rownorm.RECIPE,
        hilbert.RECIPE,
        hilbert_equi.RECIPE,
        hilbert_ctl.RECIPE,
    ],
)
