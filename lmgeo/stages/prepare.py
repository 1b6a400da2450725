"""`lmgeo prepare`: corpus → train/val/test token ids and the tokenizer (no Ray: one short process)."""

from lmgeo.driver.layout import Layout
from lmgeo.params import Params


def run(params: Params, layout: Layout, ray_address: str | None = None) -> None:
    from lmgeo.text.corpus import prepare

    summary = prepare(
        params.prepare,
        layout.tokens,
        layout.tokenizer,
        workspace=layout.root,
        allow_outside_paths=params.security.allow_outside_paths,
    )
    print(
        f"prepare: {summary.n_train_tokens:,} train, {summary.n_val_tokens:,} val and {summary.n_test_tokens:,} test "
        f"tokens ({summary.n_train_documents} + {summary.n_val_documents} + {summary.n_test_documents} documents "
        f"of {summary.source}), "
        f"{summary.tokenizer} tokenizer with {summary.vocab_size:,} tokens",
        flush=True,
    )
