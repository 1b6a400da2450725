"""GPT-NeoX / Pythia (`GPTNeoXForCausalLM`): rotary attention, parallel residual.

In transformers 5 the head is `lm_head`; Pythia checkpoints that call it `embed_out` are renamed on load.
"""

from transformers import GPTNeoXConfig, PretrainedConfig

from lmgeo.models.config import ModelSize
from lmgeo.models.family import NORMS_AND_BIASES, GroupRule, ModelFamily


def make_config(size: ModelSize, vocab_size: int, seq_len: int) -> PretrainedConfig:
    return GPTNeoXConfig(
        vocab_size=vocab_size,
        hidden_size=size.d_model,
        num_hidden_layers=size.n_layers,
        num_attention_heads=size.n_heads,
        intermediate_size=4 * size.d_model,
        max_position_embeddings=seq_len,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )


FAMILY = ModelFamily(
    name="neox",
    model_type="gpt_neox",
    kind="transformer",
    make_config=make_config,
    param_groups=(
        GroupRule("embed", r"^gpt_neox\.embed_in\.weight$"),
        GroupRule("hidden", r"\.\d+\.(?:attention|mlp)\.(?:query_key_value|dense\w*)\.weight$"),
        GroupRule("scalar", NORMS_AND_BIASES),
    ),
)
