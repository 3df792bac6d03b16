"""The training loop the benchmarks share: the Flax transformer LM (Linen
``overlap_ckpt.TrainState``), synthetic token batches committed to the device, and a donated
jitted step returning ``(state, loss)``, and a fresh train state for it: what
``benchmarks.run``'s workers, bench_host_memory, bench_tax and bench_interval train."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class LMLoop:
    config: Any  # overlap_ckpt.tools.models.LMConfig
    model: Any  # the Linen TransformerLM
    device: Any
    batches: list
    train_step: Callable
    loss_and_update: Callable  # train_step before jax.jit: to jit it with other options

    def jit_step(self, compiler_options: dict | None = None) -> Callable:
        """The step jitted as ``train_step`` is, with ``compiler_options`` (for example
        ``CheckpointManager.jit_compiler_options()``)."""
        return _jit_step(self.loss_and_update, compiler_options)

    def fresh_state(self, tx: Any = None, step: int = 0) -> Any:
        """A new ``TrainState`` of the LM (seed 0) at step counter ``step``, committed to the
        loop's device; ``tx`` defaults to ``adamw(1e-3, weight_decay=0.01)``.

        Committed (an explicit device, as the batches are), as an explicitly sharded state
        would be: without it the first step after a checkpoint window, whose outputs are
        committed, compiles again. Call it once per loop: a window ticket on the training
        thread applies to every update with the transformation it was planned for
        (``overlap_ckpt.core.window_context``), so loops must not share an optimizer object.
        """
        import jax
        import optax

        import overlap_ckpt as oc
        from overlap_ckpt.tools.models import linen_init

        tx = optax.adamw(1e-3, weight_decay=0.01) if tx is None else tx
        state = oc.TrainState.create(apply_fn=self.model.apply, params=linen_init(self.config, 0), tx=tx)
        return jax.device_put(state.replace(step=jax.numpy.asarray(step, jax.numpy.int32)), self.device)


def orbax_async_manager(directory: str, interval: int) -> Any:
    """Stock Orbax's async ``CheckpointManager`` as the benchmarks set it beside overlap_ckpt:
    a save every ``interval`` steps, the two newest kept."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        save_interval_steps=interval, max_to_keep=2, enable_async_checkpointing=True))


def orbax_save(omngr: Any, step: int, state: Any) -> bool:
    """Orbax's save of ``state``'s params and optimizer state at ``step``, as the benchmarks'
    Orbax loops call it (the tree overlap_ckpt saves, less its step counter)."""
    import orbax.checkpoint as ocp

    return omngr.save(step, args=ocp.args.StandardSave({"params": state.params, "opt_state": state.opt_state}))


def _jit_step(loss_and_update: Callable, compiler_options: dict | None = None) -> Callable:
    import jax

    return jax.jit(loss_and_update, donate_argnums=0, compiler_options=compiler_options)


def lm_loop(model_name: str, batch_size: int, distinct_batches: int = 8) -> LMLoop:
    import jax

    from overlap_ckpt.tools.models import LMConfig, SyntheticTokens, TransformerLM, linen_loss_fn

    config = LMConfig.preset(model_name)
    data = SyntheticTokens(config.vocab_size, config.seq_len, batch_size, seed=0)
    device = jax.devices()[0]
    batches = [jax.device_put({"tokens": data.batch(i)["tokens"]}, device) for i in range(distinct_batches)]

    def loss_and_update(state, batch):
        loss, grads = jax.value_and_grad(lambda p: linen_loss_fn(state.apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads=grads), loss

    return LMLoop(config, TransformerLM(config), device, batches, _jit_step(loss_and_update), loss_and_update)
