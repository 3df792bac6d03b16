"""Small decoder-only language models and a synthetic corpus for demos, examples,
tests and benchmarks of ``overlap_ckpt``.

Why here: checkpointing has to be shown on real training state (Linen param trees,
NNX module state, Adam moments) whose size can be dialled from ~0.2M to ~1B params
with :meth:`LMConfig.preset`, trained on data that is deterministic by step so
resumed runs can be checked bit for bit.
"""

from .config import LMConfig
from .data import SyntheticTokens
from .linen_lm import TransformerLM, linen_init, linen_loss_fn, next_token_loss, split_batch
from .nnx_lm import NNXTransformerLM, nnx_init, nnx_loss_fn

__all__ = [
    "LMConfig",
    "SyntheticTokens",
    "TransformerLM",
    "linen_init",
    "linen_loss_fn",
    "next_token_loss",
    "split_batch",
    "NNXTransformerLM",
    "nnx_init",
    "nnx_loss_fn",
]
