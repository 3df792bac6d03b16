"""Flax NNX version of the decoder-only transformer LM, plus init and loss helpers.

Why a second implementation: NNX keeps state inside Python objects (``nnx.Param``,
``nnx.RngState``...) and checkpointing goes through ``nnx.split``/``nnx.state``, which
is a different code path from Linen's plain param dicts. The architecture and the
parameter count are identical to :mod:`.linen_lm` (see :meth:`LMConfig.num_params`).

Dropout: with ``dropout_rate == 0`` (the default) the model holds no RNG state at all,
so its state is exactly its ``nnx.Param`` s. With ``dropout_rate > 0`` the dropout
layers own a ``"dropout"`` RNG stream (taken from the ``rngs`` passed at construction);
the stream advances inside the model, so it is part of the checkpointable state and
two runs built from the same seeds stay identical.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from .config import LMConfig
from .linen_lm import next_token_loss, split_batch

_EMBED_INIT = nnx.initializers.normal(stddev=0.02)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: LMConfig, *, rngs: nnx.Rngs) -> None:
        d = config.d_model
        dtype, pdtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        use_dropout = config.dropout_rate > 0.0
        self.ln1 = nnx.LayerNorm(d, dtype=dtype, param_dtype=pdtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=config.n_heads,
            in_features=d,
            qkv_features=d,
            out_features=d,
            dropout_rate=config.dropout_rate,
            deterministic=not use_dropout,
            decode=False,
            dtype=dtype,
            param_dtype=pdtype,
            rngs=rngs,
            keep_rngs=use_dropout,
        )
        self.drop_attn = nnx.Dropout(config.dropout_rate, rngs=rngs if use_dropout else None)
        self.ln2 = nnx.LayerNorm(d, dtype=dtype, param_dtype=pdtype, rngs=rngs)
        self.fc1 = nnx.Linear(d, config.d_ff, dtype=dtype, param_dtype=pdtype, rngs=rngs)
        self.fc2 = nnx.Linear(config.d_ff, d, dtype=dtype, param_dtype=pdtype, rngs=rngs)
        self.drop_mlp = nnx.Dropout(config.dropout_rate, rngs=rngs if use_dropout else None)

    def __call__(self, x: jax.Array, mask: jax.Array, deterministic: bool | None = None) -> jax.Array:
        h = self.attn(self.ln1(x), mask=mask, deterministic=deterministic)
        x = x + self.drop_attn(h, deterministic=deterministic)
        h = self.fc2(nnx.gelu(self.fc1(self.ln2(x))))
        return x + self.drop_mlp(h, deterministic=deterministic)


class NNXTransformerLM(nnx.Module):
    """Decoder-only LM, same architecture as the Linen ``TransformerLM``.

    ``model(tokens [B, T] int, deterministic=None) -> logits [B, T, vocab]``.
    Dropout layers start in training mode (the NNX convention); ``model.eval()`` /
    ``model.train()`` switch modes, or pass ``deterministic`` explicitly per call.
    """

    def __init__(self, config: LMConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        d = config.d_model
        dtype, pdtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        use_dropout = config.dropout_rate > 0.0
        self.tok_embed = nnx.Embed(config.vocab_size, d, embedding_init=_EMBED_INIT,
                                   dtype=dtype, param_dtype=pdtype, rngs=rngs)
        self.pos_embed = nnx.Param(_EMBED_INIT(rngs.params(), (config.seq_len, d), pdtype))
        self.drop_embed = nnx.Dropout(config.dropout_rate, rngs=rngs if use_dropout else None)
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layers)])
        self.ln_f = nnx.LayerNorm(d, dtype=dtype, param_dtype=pdtype, rngs=rngs)
        self.head = (None if config.tie_embeddings else
                     nnx.Linear(d, config.vocab_size, use_bias=False, dtype=dtype,
                                param_dtype=pdtype, rngs=rngs))

    def __call__(self, tokens: jax.Array, deterministic: bool | None = None) -> jax.Array:
        cfg = self.config
        seq = tokens.shape[-1]
        if seq > cfg.seq_len:
            raise ValueError(f"sequence length {seq} exceeds config.seq_len={cfg.seq_len}")
        x = self.tok_embed(tokens) + self.pos_embed[...][:seq].astype(jnp.dtype(cfg.dtype))
        x = self.drop_embed(x, deterministic=deterministic)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask, deterministic)
        x = self.ln_f(x)
        if self.head is None:
            return self.tok_embed.attend(x)
        return self.head(x)


def nnx_init(config: LMConfig, seed: int = 0, dropout_seed: int | None = None) -> NNXTransformerLM:
    """Build a model from integer seeds (``dropout_seed`` defaults to ``seed + 1``)."""
    dropout_seed = seed + 1 if dropout_seed is None else dropout_seed
    return NNXTransformerLM(config, rngs=nnx.Rngs(params=seed, dropout=dropout_seed))


def nnx_loss_fn(model: NNXTransformerLM, batch: Mapping[str, Any]) -> jax.Array:
    """Next-token cross-entropy of ``model`` on ``batch``; differentiate with
    ``nnx.value_and_grad(nnx_loss_fn)(model, batch)``. Dropout follows the model's
    current train/eval mode."""
    inputs, targets = split_batch(batch)
    return next_token_loss(model(inputs), targets)
