"""The recipe every other one is compared with in Study B (`muon`, SPEC §3.2)."""

from lmgeo.study_b.recipes import RECIPES
from lmgeo.study_b.recipes.base import HeadRecipe


def baseline() -> HeadRecipe:
    return next(r for r in RECIPES if r.baseline)
