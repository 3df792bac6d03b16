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

# The NNX model loads on first use (see __getattr__).
_NNX_NAMES = ("NNXTransformerLM", "nnx_init", "nnx_loss_fn")

__all__ = [
    "LMConfig",
    "SyntheticTokens",
    "TransformerLM",
    "linen_init",
    "linen_loss_fn",
    "next_token_loss",
    "split_batch",
    *_NNX_NAMES,
]


def __getattr__(name):
    """The NNX model on first use: flax.nnx takes about 1 s to import, which the Linen
    demo, the CLI and the Linen benchmarks never need."""
    if name not in _NNX_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import nnx_lm

    return getattr(nnx_lm, name)
