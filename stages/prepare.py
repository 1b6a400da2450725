"""`lmgeo prepare`: corpus → train/val token ids and the tokenizer (no Ray: one short process)."""

from pipeline.core.config import Params
from pipeline.text.corpus import prepare
from stages.layout import Layout


def run(params: Params, ray_address: str | None = None) -> None:
    layout = Layout.here()
    summary = prepare(
        params.prepare,
        layout.tokens,
        layout.tokenizer,
        workspace=layout.root,
        allow_outside_paths=params.security.allow_outside_paths,
    )
    print(f"prepare: {summary}", flush=True)
