"""Tiny models, optimizers and data of the loop styles (a few thousand parameters each).

Nothing here imports overlap_ckpt: the app's own restore code with stock Orbax
(``orbax_reader.py``) builds its abstract tree from these definitions.
"""

from __future__ import annotations

import flax.linen as nn
import numpy as np
import optax
from flax import nnx

FEATURES, CLASSES, HIDDEN, BATCH = 16, 4, 32, 8
SEED = 0


def batch(t: int, seed: int = SEED) -> dict[str, np.ndarray]:
    """The batch of step ``t``: a pure function of (seed, t), so every run sees the same data."""
    rng = np.random.default_rng([seed, t])
    x = rng.standard_normal((BATCH, FEATURES), dtype=np.float32)
    return {"x": x, "y": rng.integers(0, CLASSES, BATCH).astype(np.int32)}


def image_batch(t: int, seed: int = SEED) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, t])
    return {"image": rng.standard_normal((BATCH, 8, 8, 1), dtype=np.float32),
            "label": rng.integers(0, CLASSES, BATCH).astype(np.int32)}


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class MLP(nn.Module):
    """Two dense layers; with ``partition`` the kernels are FSDP-sharded along their rows
    (``nn.with_partitioning``, as in Flax's "scale up on multiple devices" guide)."""

    partition: str | None = None
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        init = nn.initializers.lecun_normal()
        if self.partition is not None:
            init = nn.with_partitioning(init, (self.partition, None))
        x = nn.relu(nn.Dense(HIDDEN, kernel_init=init)(x))
        if self.dropout:
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(CLASSES, kernel_init=init)(x)


class CNN(nn.Module):
    """Conv + BatchNorm (imagenet example in miniature)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        return nn.Dense(CLASSES)(x.reshape((x.shape[0], -1)))


class NnxMLP(nnx.Module):
    """NNX: Linear -> BatchNorm -> relu -> Dropout -> Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.bn = nnx.BatchNorm(HIDDEN, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.bn(self.linear1(x)))))


def app_model() -> MLP:
    return MLP()


def app_tx() -> optax.GradientTransformation:
    return optax.adamw(1e-2, weight_decay=1e-4)
