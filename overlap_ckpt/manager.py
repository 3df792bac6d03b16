"""``CheckpointManager``: Orbax-like front door of overlapped checkpointing.

One object owns the storage (:class:`overlap_ckpt.storage.CheckpointStore`) and the
overlap engine (:class:`overlap_ckpt.engine.OverlapEngine`). The training loop calls
:meth:`CheckpointManager.step` once per step, after its jitted train step; the manager
hands the step's captured outbox to the engine, and attaches the plan and window phase of
the *next* step to the state. It never waits on the device: the step number is read once
(:meth:`prepare`) and counted on the host afterwards.

Supported states: :class:`overlap_ckpt.flax_linen.TrainState` (and subclasses) and
:class:`overlap_ckpt.nnx_optimizer.Optimizer` (with its model, see :meth:`prepare`).

Saved tree (what stock Orbax restores)::

    Linen: {"step", "params", "opt_state", <user fields of the TrainState subclass>}
    NNX:   {"step", "params", "opt_state", ["model_state"]}
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .engine import OverlapEngine
from .errors import ConfigError
from .hostarray import HostArray, HostShard, normalize_index
from . import flax_linen

log = logging.getLogger(__name__)

_AUTO_MEASURE_STEPS = 5  # steps timed on accelerators before choosing K (window="auto")


def _combine(params, opt_state, extras) -> dict:
    return {"params": params, "opt_state": opt_state, **extras}


def _snapshot_leaf(x: Any) -> Any:
    """A host copy of ``x`` that owns its memory (no view of a buffer donation may reuse)."""
    if isinstance(x, jax.Array):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            raise TypeError("typed PRNG key arrays cannot be checkpointed yet; store "
                            "jax.random.key_data(key) in the state instead")
        shards = []
        seen = set()
        for shard in x.addressable_shards:
            index = normalize_index(shard.index, x.shape)
            key = tuple((s.start, s.stop) for s in index)
            if shard.replica_id != 0 or key in seen:
                continue
            seen.add(key)
            shards.append(HostShard(index, np.array(shard.data, copy=True)))
        return HostArray(tuple(x.shape), np.dtype(x.dtype), shards)
    if isinstance(x, (np.ndarray, np.generic, int, float, bool)):
        return HostArray.from_numpy(np.array(x, copy=True))
    return x


def _abstract(x: Any) -> Any:
    """Restore target of one leaf: shape, dtype and sharding of ``x``."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    arr = jnp.asarray(x)  # Python scalars: the dtype JAX would give them (int32 without x64)
    return jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=arr.sharding)


def _is_nnx_optimizer(obj: Any) -> bool:
    try:
        from .nnx_optimizer import Optimizer
    except ImportError:  # pragma: no cover - flax without nnx
        return False
    return isinstance(obj, Optimizer)


def _check_linen_state(state: Any) -> None:
    if isinstance(state, flax_linen.TrainState):
        return
    if flax_linen.is_plain_flax_train_state(state):
        raise TypeError(
            f"CheckpointManager got a {type(state).__module__}.{type(state).__qualname__}, a plain "
            "flax.training.train_state.TrainState: its apply_gradients cannot capture checkpoint "
            "windows. Use overlap_ckpt.TrainState (overlap_ckpt.flax_linen.TrainState) instead: "
            "it is a drop-in subclass, e.g. `state = overlap_ckpt.TrainState.create(apply_fn=..., "
            "params=..., tx=...)`, and subclass it instead of Flax's for extra fields.")
    try:
        from flax import nnx
        if isinstance(state, nnx.Optimizer):
            raise TypeError(
                "CheckpointManager got a plain flax.nnx.Optimizer: its update() cannot capture "
                "checkpoint windows. Use overlap_ckpt.nnx_optimizer.Optimizer(model, tx, wrt=...) "
                "instead (a drop-in subclass).")
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"CheckpointManager needs an overlap_ckpt.TrainState or an "
                    f"overlap_ckpt.nnx_optimizer.Optimizer, got {type(state).__name__}")


class CheckpointManager:
    """Overlapped checkpoints every ``save_interval_steps`` steps, Orbax-style names.

    Args:
      directory: where checkpoints go (any location :class:`CheckpointStore` accepts).
      save_interval_steps: checkpoint the state of every step that is a multiple of this.
      max_to_keep, keep_every_n_steps: retention, as in Orbax.
      window: steps K a checkpoint is spread over. ``"auto"``: 1 on the CPU backend; on
        accelerators K is chosen by :func:`overlap_ckpt.costmodel.choose_k` from the measured
        step time and device-to-host bandwidth (K=1 until measured).
      store: an already-open store (or any object with ``save/wait_until_finished/
        latest_step/all_steps/restore/close``) instead of opening ``directory``.
      persist_bytes_per_s: storage bandwidth assumed by ``window="auto"``.
    """

    def __init__(self, directory: Any = None, *, save_interval_steps: int, max_to_keep: int | None = None,
                 keep_every_n_steps: int | None = None, window: int | str = "auto", store: Any = None,
                 persist_bytes_per_s: float = 1e9):
        if isinstance(save_interval_steps, bool) or not isinstance(save_interval_steps, int) \
                or save_interval_steps < 1:
            raise ConfigError(f"save_interval_steps must be an int >= 1, got {save_interval_steps!r}")
        if window != "auto" and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ConfigError(f"window must be 'auto' or an int >= 1, got {window!r}")
        if store is None:
            if directory is None:
                raise ConfigError("CheckpointManager needs a directory (or store=)")
            from .storage import CheckpointStore
            store = CheckpointStore(directory, max_to_keep=max_to_keep, keep_every_n_steps=keep_every_n_steps)
        self.store = store
        self.directory = directory
        self.save_interval_steps = save_interval_steps
        self.window = window
        self.persist_bytes_per_s = persist_bytes_per_s
        self.engine: OverlapEngine | None = None
        self._tx = None
        self._kind: str | None = None  # "linen" or "nnx"
        self._model = None  # NNX: the model the optimizer updates
        self._next_step: int | None = None  # version of the input state of the next step
        self._plan = None
        self._phase: int | None = None
        self._skip_version: int | None = None  # window joined mid-way (after a resume)
        self._sync_saved: set[int] = set()  # versions saved by save() or on storage: not captured
        self._windows: set[int] = set()  # versions whose last phase was submitted
        self._auto: dict | None = None  # window="auto" measurement on accelerators
        self._closed = False

    # -- the per-step API ------------------------------------------------------------------
    def prepare(self, state: Any, model: Any = None) -> Any:
        """Attach the checkpoint plan and phase to a fresh or restored state (one host sync).

        Linen: returns the state to train with. NNX: pass ``(optimizer, model)``; the optimizer
        is updated in place and returned.
        """
        self._check_open()
        if _is_nnx_optimizer(state):
            if model is None:
                model = self._model
            if model is None:
                raise TypeError("prepare(optimizer, model): the NNX integration needs the model the "
                                "optimizer updates")
            self._kind, self._model = "nnx", model
            step = int(state.step[...])
        else:
            _check_linen_state(state)
            self._kind = "linen"
            state = _committed(flax_linen.with_step_array(state))
            step = int(state.step)
        self._ensure_engine(state)
        self._next_step = step
        # Versions already on storage (a resume from an older step): never captured again.
        self._sync_saved.update(int(s) for s in self.store.all_steps())
        phase = self.engine.phase(step)
        # A window already under way at this step cannot complete (its first phases ran
        # before this state existed): train through it without capturing.
        self._skip_version = self.engine.schedule.target(step) if phase not in (None, 0) else None
        if self._auto is not None:
            self._auto.update(start=None, start_step=None)
        return self._attach(state, step)

    def step(self, state: Any) -> Any:
        """Take the outbox of the step that produced ``state`` and prepare the next step.

        Call once per training step, after the jitted step, with the state it returned
        (NNX: the optimizer). Returns the state to feed to the next step.
        """
        self._check_open()
        if self._kind is None or self._next_step is None:
            log.info("CheckpointManager.step called before prepare(); preparing now")
            return self.prepare(state)
        nnx = self._kind == "nnx"
        if nnx:
            if not _is_nnx_optimizer(state):
                _check_linen_state(state)  # raises the right TypeError
        else:
            _check_linen_state(state)
        t, phase, plan = self._next_step, self._phase, self._plan
        if state.ckpt_plan is not plan or state.ckpt_phase != phase:
            log.warning("the state given to CheckpointManager.step was not prepared by it for "
                        "step %d; re-synchronising (one host sync)", t)
            return self.prepare(self._clear(state))
        outbox = state.ckpt_outbox
        if phase is not None:
            if outbox is None:
                raise RuntimeError(
                    f"step {t} is in phase {phase} of a checkpoint window but the state carries no "
                    "outbox: call CheckpointManager.step exactly once per training step, with the "
                    "state returned by a step that called apply_gradients (NNX: optimizer.update).")
            version = t - phase + plan.k - 1
            if version not in self._sync_saved:
                self.engine.submit(t, phase, outbox, {"framework": self._kind, "window": plan.k})
                if phase == plan.k - 1:
                    self._windows.add(version)
        state = self._clear(state)
        self._next_step = t + 1
        self._measure(state, t + 1)
        return self._attach(state, t + 1)

    step_nnx = step

    def should_save(self, step: int) -> bool:
        return step > 0 and step % self.save_interval_steps == 0

    # -- explicit saves and restores -------------------------------------------------------
    def save(self, step: int, state: Any, force: bool = False) -> bool:
        """Synchronous snapshot of ``state`` as checkpoint ``step`` (e.g. at the end of
        training); the write itself is in the background. Returns False when nothing was
        saved: ``step`` is not a save step (and not ``force``), or its window already saved it.
        """
        self._check_open()
        step = int(step)
        if step in self._windows or step in self._sync_saved:
            return False
        if not (force or self.should_save(step)):
            return False
        if step in self.store.all_steps():
            return False
        if _is_nnx_optimizer(state):
            if self._model is None:
                raise TypeError("call prepare(optimizer, model) before save() for NNX")
            from .nnx_optimizer import nnx_extras, model_params, to_plain
            from flax import nnx as _nnx
            tree = to_plain(_combine(model_params(state, self._model), _nnx.as_pure(state.opt_state),
                                     nnx_extras(state, self._model)))
            kind = "nnx"
        else:
            _check_linen_state(state)
            tree = _combine(state.params, state.opt_state, flax_linen.state_extras(state))
            kind = "linen"
        host = jax.tree.map(_snapshot_leaf, tree)
        self.store.save(step, host, {"framework": kind, "window": 0})
        self._sync_saved.add(step)
        return True

    def restore(self, step: int | None = None, target_state: Any = None, *, model: Any = None) -> Any:
        """Read checkpoint ``step`` (latest when None) into the structure, shapes, dtypes and
        shardings of ``target_state`` and return it prepared for training.

        Linen: ``target_state`` is a (freshly initialised) ``overlap_ckpt.TrainState``; a new
        state is returned. NNX: ``target_state`` is the optimizer and ``model=`` its model;
        both are updated in place and the optimizer returned. A mismatch of structure,
        shape or dtype raises an error naming the leaf, the saved and the given shape/dtype.
        """
        self._check_open()
        if target_state is None:
            raise TypeError("restore needs target_state= (a freshly initialised state to fill)")
        if step is None:
            step = self.store.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if _is_nnx_optimizer(target_state):
            model = model if model is not None else self._model
            if model is None:
                raise TypeError("restore(step, target_state=optimizer, model=model) for NNX")
            return self._restore_nnx(step, target_state, model)
        _check_linen_state(target_state)
        target_state = flax_linen.with_step_array(target_state)
        like = _combine(target_state.params, target_state.opt_state, flax_linen.state_extras(target_state))
        tree, _ = self.store.restore(step, target=jax.tree.map(_abstract, like))
        fields = {k: v for k, v in tree.items() if k not in ("params", "opt_state")}
        state = self._clear(target_state).replace(params=tree["params"], opt_state=tree["opt_state"], **fields)
        return self.prepare(state)

    def _restore_nnx(self, step: int, optimizer: Any, model: Any) -> Any:
        from flax import nnx
        from .nnx_optimizer import from_plain, model_params, nnx_extras, to_plain
        like = _combine(model_params(optimizer, model), nnx.as_pure(optimizer.opt_state),
                        nnx_extras(optimizer, model))
        tree, _ = self.store.restore(step, target=to_plain(jax.tree.map(_abstract, like)))
        restored = from_plain(tree, like)
        nnx.update(model, restored["params"])
        if "model_state" in restored:
            nnx.update(model, restored["model_state"])
        nnx.update(optimizer.opt_state, nnx.state(restored["opt_state"], graph=optimizer.graph))
        optimizer.step[...] = restored["step"]
        optimizer.ckpt_plan = None
        optimizer.ckpt_phase = None
        optimizer.ckpt_outbox = None
        return self.prepare(optimizer, model)

    # -- Orbax-like queries and lifetime ---------------------------------------------------
    def latest_step(self) -> int | None:
        return self.store.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.store.all_steps())

    def wait_until_finished(self) -> None:
        """Block until every captured window is replayed and every checkpoint persisted."""
        if self.engine is not None:
            self.engine.wait_until_finished()
        self.store.wait_until_finished()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            if self.engine is not None:
                self.engine.close()
            self.store.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - do not hide the original exception
            log.exception("error while closing the CheckpointManager during another exception")

    # -- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed")

    def _trees(self, state: Any) -> tuple[Any, Any, Any]:
        if self._kind == "nnx":
            from flax import nnx
            from .nnx_optimizer import model_params, nnx_extras
            return (model_params(state, self._model), nnx.as_pure(state.opt_state),
                    nnx_extras(state, self._model))
        return state.params, state.opt_state, flax_linen.state_extras(state)

    def _ensure_engine(self, state: Any) -> None:
        tx = state.tx
        if self.engine is not None and self._tx is tx:
            return
        if self.engine is not None:
            self.engine.wait_until_finished()
            self.engine.close()
        combine = _combine
        if self._kind == "nnx":
            from .nnx_optimizer import to_plain
            combine = lambda p, o, e: to_plain(_combine(p, o, e))  # noqa: E731
        self.engine = OverlapEngine(tx, self.store, interval=self.save_interval_steps,
                                    window=self._initial_window(state), combine=combine)
        self._tx = tx
        self._plan = None

    def _initial_window(self, state: Any) -> int:
        if self.window != "auto":
            return self.window
        leaves = jax.tree.leaves(self._trees(state)[0])
        platform = next(iter(leaves[0].sharding.device_set)).platform if leaves else "cpu"
        if platform == "cpu":
            return 1
        try:
            from . import costmodel
            costmodel.choose_k  # noqa: B018
        except (ImportError, AttributeError):
            log.info("overlap_ckpt.costmodel unavailable; window='auto' uses K=1")
            return 1
        self._auto = {"start": None, "start_step": None, "device": next(iter(leaves[0].sharding.device_set))}
        return 1

    def _measure(self, state: Any, step: int) -> None:
        """window="auto" on accelerators: time a few steps (two host syncs), then choose K."""
        auto = self._auto
        if auto is None or self._phase is not None or self._plan is None:
            return
        leaf = jax.tree.leaves(self._trees(state)[0])[0]
        if auto["start"] is None:
            leaf.block_until_ready()
            auto.update(start=time.perf_counter(), start_step=step)
            return
        if step - auto["start_step"] < _AUTO_MEASURE_STEPS:
            return
        leaf.block_until_ready()
        step_time = (time.perf_counter() - auto["start"]) / (step - auto["start_step"])
        from . import costmodel
        plan = self._plan
        try:
            bandwidth = costmodel.measure_d2h_bandwidth(auto["device"])
            profile = costmodel.TrainingProfile(
                step_time_s=step_time, d2h_bytes_per_s=bandwidth, state_bytes=plan.state_bytes,
                grad_bytes=plan.grad_bytes, persist_bytes_per_s=self.persist_bytes_per_s)
            k = costmodel.choose_k(profile, interval_steps=self.save_interval_steps)
        except Exception as e:  # noqa: BLE001 - auto-tuning must never break training
            log.warning("window='auto' could not choose K (%s); keeping K=1", e)
            k = 1
        self._auto = None
        log.info("window='auto': step %.4fs, K=%d", step_time, k)
        if k != self.engine.schedule.k:
            self.engine.set_window(k)
            self._plan = None

    def _attach(self, state: Any, step: int) -> Any:
        """Set plan and phase of the step whose input is ``state`` (version ``step``)."""
        engine = self.engine
        phase = engine.phase(step)
        if self._plan is None or phase == 0:
            self._plan = engine.plan_for(*self._trees(state))  # re-plans if the tree changed
            phase = engine.phase(step)
        if phase is not None and self._skip_version is not None:
            if engine.schedule.target(step) == self._skip_version:
                phase = None
            else:
                self._skip_version = None
        if phase is not None and (step - phase + self._plan.k - 1) in self._sync_saved:
            phase = None
        self._phase = phase
        if self._kind == "nnx":
            state.ckpt_plan, state.ckpt_phase = self._plan, phase
            return state
        return state.replace(ckpt_plan=self._plan, ckpt_phase=phase)

    def _clear(self, state: Any) -> Any:
        if self._kind == "nnx" or _is_nnx_optimizer(state):
            state.ckpt_outbox = None
            return state
        return state.replace(ckpt_outbox=None)


__all__ = ["CheckpointManager"]


def _committed(tree: Any) -> Any:
    """Commit every array to the sharding it already has.

    A freshly initialised state holds *uncommitted* arrays, while a window step returns
    arrays committed to their devices (its pinned-host outputs pin the placement). Jit
    keys its cache on that difference, so without this the first window step and the
    first step after it would each compile the train step once more.
    """
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, tree)
