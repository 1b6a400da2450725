"""The registered model families Study B can train (and whose structure overrides Study A uses): one module
each, named as the family, listed here and nowhere else. An index only (SPEC §1: a shard's code version
holds the members it uses, so this file must hold nothing but the list)."""

from lmgeo.core.registry import Registry
from lmgeo.models.families import gpt2, mamba, neox
from lmgeo.models.family import ModelFamily

FAMILIES: Registry[ModelFamily] = Registry("model family", [gpt2.FAMILY, neox.FAMILY, mamba.FAMILY])
