"""Flax Linen decoder-only transformer LM, plus init and loss helpers.

Why it exists: the checkpointing library must be exercised on a realistic Linen train
state (nested param dicts, Adam moments, many differently-shaped leaves). The model is
deliberately plain -- no BatchNorm, no mutable collections -- so the whole training
state is ``params`` + optimizer state, and, with ``dropout_rate=0``, every step is a
pure function of (params, batch): bitwise reproducible on CPU.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from .config import LMConfig

Params = Any
Batch = Mapping[str, Any]

_EMBED_INIT = nn.initializers.normal(stddev=0.02)


def split_batch(batch: Batch) -> tuple[jax.Array, jax.Array]:
    """``(inputs, targets)`` from either ``{"tokens": [B, T+1]}`` (targets are the
    inputs shifted by one) or explicit ``{"inputs": [B, T], "targets": [B, T]}``."""
    if "tokens" in batch:
        tokens = jnp.asarray(batch["tokens"])
        return tokens[:, :-1], tokens[:, 1:]
    return jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, computed in float32 even for bfloat16 models."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return losses.mean()


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    config: LMConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, deterministic: bool) -> jax.Array:
        cfg = self.config
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        h = nn.LayerNorm(dtype=dtype, param_dtype=pdtype, name="ln1")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=cfg.n_heads,
            qkv_features=cfg.d_model,
            out_features=cfg.d_model,
            dropout_rate=cfg.dropout_rate,
            dtype=dtype,
            param_dtype=pdtype,
            name="attn",
        )(h, h, mask=mask, deterministic=deterministic)
        x = x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        h = nn.LayerNorm(dtype=dtype, param_dtype=pdtype, name="ln2")(x)
        h = nn.Dense(cfg.d_ff, dtype=dtype, param_dtype=pdtype, name="fc1")(h)
        h = nn.gelu(h)
        h = nn.Dense(cfg.d_model, dtype=dtype, param_dtype=pdtype, name="fc2")(h)
        return x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)


class TransformerLM(nn.Module):
    """Decoder-only LM: token + learned position embedding, ``n_layers`` pre-LN blocks,
    final LayerNorm, tied (default) or untied bias-free output head.

    ``__call__(tokens [B, T] int, train=False) -> logits [B, T, vocab]`` with
    ``T <= config.seq_len``. With ``train=True`` and ``dropout_rate > 0`` a
    ``"dropout"`` rng must be passed to ``apply``.
    """

    config: LMConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        cfg = self.config
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        deterministic = not train or cfg.dropout_rate == 0.0
        seq = tokens.shape[-1]
        if seq > cfg.seq_len:
            raise ValueError(f"sequence length {seq} exceeds config.seq_len={cfg.seq_len}")

        tok_embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_EMBED_INIT,
                             dtype=dtype, param_dtype=pdtype, name="tok_embed")
        pos_embed = self.param("pos_embed", _EMBED_INIT, (cfg.seq_len, cfg.d_model), pdtype)
        x = tok_embed(tokens) + pos_embed[:seq].astype(dtype)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)

        mask = nn.make_causal_mask(tokens)
        for i in range(cfg.n_layers):
            x = Block(cfg, name=f"block_{i}")(x, mask, deterministic)
        x = nn.LayerNorm(dtype=dtype, param_dtype=pdtype, name="ln_f")(x)

        if cfg.tie_embeddings:
            return tok_embed.attend(x)
        return nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=pdtype,
                        name="head")(x)


@functools.lru_cache(maxsize=None)
def _jitted_init(config: LMConfig) -> Callable[[jax.Array], Params]:
    """One compiled init program per config: jit lets XLA drop the forward pass that
    ``Module.init`` traces, and the cache makes repeated inits (tests, benchmark
    repetitions, restarts in one process) skip recompilation."""

    def init(rng: jax.Array) -> Params:
        tokens = jnp.zeros((1, config.seq_len), jnp.int32)
        return TransformerLM(config).init({"params": rng}, tokens)["params"]

    return jax.jit(init)


def linen_init(config: LMConfig, rng: jax.Array | int) -> Params:
    """Initialise and return the ``params`` collection (the model has no other state).

    ``rng`` may be a PRNG key or an int seed. The result does not depend on
    ``dropout_rate`` (dropout has no parameters), so a dropout variant of a config
    can share params with the plain one."""
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    return _jitted_init(config.replace(dropout_rate=0.0))(rng)


def linen_loss_fn(
    apply_fn: Callable[..., jax.Array],
    params: Params,
    batch: Batch,
    rngs: Mapping[str, jax.Array] | None = None,
) -> jax.Array:
    """Next-token cross-entropy of ``TransformerLM(...).apply`` on ``batch``.

    Passing ``rngs`` (e.g. ``{"dropout": key}``) runs the model in training mode, so
    dropout is active when ``dropout_rate > 0``; ``rngs=None`` is evaluation mode.
    """
    inputs, targets = split_batch(batch)
    logits = apply_fn({"params": params}, inputs, train=rngs is not None, rngs=rngs)
    return next_token_loss(logits, targets)
