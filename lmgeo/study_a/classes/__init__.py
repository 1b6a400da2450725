"""The registered function classes of Study A, in the order reports list them: one module each, named as the
class. An index only: a shard's code version holds the classes it fits (SPEC §1), so this file holds nothing
but the list."""

from lmgeo.core.registry import Registry
from lmgeo.study_a.classes import affine, diag_psd, global_linear, identity, lowrank, mlp, orthogonal, similarity
from lmgeo.study_a.classes.base import FitClass

FIT_CLASSES: Registry[FitClass] = Registry(
    "function class",
    [
        diag_psd.CLASS,
        lowrank.CLASS,
        orthogonal.CLASS,
        similarity.CLASS,
        affine.CLASS,
        mlp.CLASS,
        identity.CLASS,
        global_linear.CLASS,
    ],
)
