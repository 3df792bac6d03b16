"""Shape and dtype description of the demo/benchmark language models.

Why a separate, framework-free module: the CLI, the examples and the benchmarks need to
know how big a model's state is (to size buffers, label plots, pick a preset for the
machine) *before* anything is initialised. :meth:`LMConfig.num_params` therefore
computes the parameter count analytically; ``tests/test_models.py`` checks that the
formula matches what the Linen and NNX implementations actually create.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

DType = Literal["float32", "bfloat16"]
_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Decoder-only transformer hyper-parameters (GPT-2 style, learned positions).

    Frozen so a config can be a static argument of ``jax.jit`` and a dict key.

    Attributes:
      vocab_size: number of token ids.
      d_model: residual-stream width; must be divisible by ``n_heads``.
      n_layers: number of pre-LayerNorm transformer blocks.
      n_heads: attention heads per block.
      d_ff: hidden width of the gelu MLP.
      seq_len: maximum sequence length (size of the learned position table).
      dtype: compute dtype of activations/matmuls.
      param_dtype: storage dtype of the parameters (float32 by default so optimizer
        updates and checkpoints are exact; bfloat16 halves the state size).
      dropout_rate: residual/attention/embedding dropout. Default 0.0 so training is
        bitwise reproducible without caring about dropout keys.
      tie_embeddings: reuse the token embedding as the output projection (no extra
        ``d_model * vocab_size`` head matrix).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    seq_len: int
    dtype: DType = "float32"
    param_dtype: DType = "float32"
    dropout_rate: float = 0.0
    tie_embeddings: bool = True

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # ~0.2M params: CI smoke tests and unit tests. Two layers keep XLA compile time
        # (which dominates on CPU) low; a train step is milliseconds.
        "tiny": dict(vocab_size=512, d_model=80, n_layers=2, n_heads=4, d_ff=320, seq_len=64),
        # ~2.0M params: quick local demos.
        "small": dict(vocab_size=1024, d_model=192, n_layers=4, n_heads=6, d_ff=768, seq_len=128),
        # ~21.1M params; params + Adam mu/nu in float32 = ~242 MiB of state.
        "20m": dict(vocab_size=16384, d_model=512, n_layers=4, n_heads=8, d_ff=2048, seq_len=256),
        # ~98M params (GPT-2-small shape with a 16k vocab).
        "100m": dict(vocab_size=16384, d_model=768, n_layers=12, n_heads=12, d_ff=3072, seq_len=512),
        # ~0.98B params: GPU only.
        "1b": dict(vocab_size=32768, d_model=2048, n_layers=18, n_heads=16, d_ff=8192, seq_len=1024),
    }

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {sorted(_DTYPE_BYTES)}, got {getattr(self, name)!r}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "LMConfig":
        """A named preset ("tiny", "small", "20m", "100m", "1b"), optionally with fields
        overridden (e.g. ``LMConfig.preset("1b", dtype="bfloat16")``)."""
        try:
            base = cls.PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(cls.PRESETS)}") from None
        return cls(**{**base, **overrides})

    def replace(self, **changes: Any) -> "LMConfig":
        """Copy with some fields changed (the dataclass is frozen)."""
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Exact parameter count of both implementations, computed from the shapes.

        Per block: 2 LayerNorms (scale+bias), q/k/v/out projections with biases,
        and a two-layer MLP with biases. Plus token and position tables, the final
        LayerNorm and, if untied, a bias-free ``d_model x vocab_size`` head.
        """
        d, f, v = self.d_model, self.d_ff, self.vocab_size
        layer_norm = 2 * d
        attention = 4 * (d * d + d)
        mlp = d * f + f + f * d + d
        block = 2 * layer_norm + attention + mlp
        embeddings = v * d + self.seq_len * d
        head = 0 if self.tie_embeddings else d * v
        return embeddings + self.n_layers * block + layer_norm + head

    def param_bytes(self) -> int:
        """Bytes of the parameters alone, in ``param_dtype``."""
        return self.num_params() * _DTYPE_BYTES[self.param_dtype]

    def adam_state_bytes(self) -> int:
        """Bytes of params plus Adam's two moments (stored in ``param_dtype``), i.e. the
        size of a typical training-state checkpoint (step counters not included)."""
        return 3 * self.param_bytes()
