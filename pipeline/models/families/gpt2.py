"""GPT-2 (`GPT2LMHeadModel`): learned positions, Conv1D projections stored (in, out)."""

from transformers import GPT2Config, PretrainedConfig

from pipeline.models.config import ModelSize
from pipeline.models.family import NORMS_AND_BIASES, GroupRule, ModelFamily


# Dropout is off and special-token ids are cleared: small research models are trained without dropout,
# and the family's default token ids (50256) do not exist in a small vocabulary.
def make_config(size: ModelSize, vocab_size: int, seq_len: int) -> PretrainedConfig:
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=size.d_model,
        n_layer=size.n_layers,
        n_head=size.n_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )


FAMILY = ModelFamily(
    name="gpt2",
    model_type="gpt2",
    kind="transformer",
    make_config=make_config,
    param_groups=(
        GroupRule("embed", r"^transformer\.(?:wte|wpe)\.weight$"),
        GroupRule("hidden", r"\.\d+\.(?:attn|mlp)\.(?:c_attn|c_proj|c_fc)\.weight$"),
        GroupRule("scalar", NORMS_AND_BIASES),
    ),
    hidden_stored_transposed=True,
)
