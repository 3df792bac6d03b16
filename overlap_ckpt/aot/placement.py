"""A user's step and the arguments of one call, moved onto a target's devices, abstractly.

Why: "does my step's window overlap on an H100" is asked on a CPU machine, where the state
is this machine's (concrete arrays, or ``jax.ShapeDtypeStruct``s on its devices). XLA
compiles for a target from arguments placed on the target's devices, and a compile-only
device holds no buffer: every array becomes a ``ShapeDtypeStruct`` there, and nothing is
allocated (docs/aot.md, "Your own step, in one call").

The rules, one per kind of leaf:

* a ``NamedSharding`` keeps its ``PartitionSpec`` (and memory kind, and the mesh's axis
  names and axis types) on a mesh of the target's devices. With as many target devices as
  the mesh has, they take the mesh's shape. Otherwise the mesh's largest axis (the last of
  equals: the innermost, where FSDP and tensor axes usually are) takes every target device
  and the other axes one each; ``mesh_shape`` gives the sizes instead. A dimension that
  does not divide over its axes there is refused, naming the leaf;
* a leaf on one device, replicated, uncommitted, a numpy array or a ``ShapeDtypeStruct``
  without a sharding: replicated over all the target's devices;
* any other sharding (one that splits without naming mesh axes) is refused, naming the leaf;
* other leaves (Python numbers, strings) are left as they are;
* NNX objects among the arguments are split together, moved and merged again, so that what
  they share stays shared (as ``compile_ahead`` makes them abstract);
* a ``jax.jit`` step whose ``in_shardings``/``out_shardings`` name shardings is jitted again
  with the same options and those shardings moved by the same rules. Shardings the step's
  body names itself (``with_sharding_constraint`` on a mesh of this machine) cannot be
  moved, and are refused with the fix: ``PartitionSpec``s under ``jax.set_mesh``, whose
  mesh is moved for the lowering, or the jit's own shardings.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..doors.abstract import graph_nodes
from ..doors.base import imported_nnx
from .targets import Target


class PlacementError(ValueError):
    """An argument or a step that cannot be moved onto the target's devices."""


class Placement:
    """Moves shardings onto ``target``'s devices (the rules: module docstring). One mesh per
    mesh of the arguments, all over the target's devices in one order, so that jit sees one
    device assignment."""

    def __init__(self, target: Target, mesh_shape: Mapping[str, int] | None = None):
        self.target = target
        self.mesh_shape = dict(mesh_shape) if mesh_shape else None
        self._meshes: dict[Mesh, Mesh] = {}
        self._replicated: NamedSharding | None = None

    # -- meshes and shardings ------------------------------------------------------------------
    def mesh(self, mesh: Mesh) -> Mesh:
        """``mesh``'s axes over the target's devices."""
        if mesh not in self._meshes:
            sizes = self.axis_sizes(mesh)
            devices = np.array(self.target.devices, dtype=object).reshape(tuple(sizes.values()))
            self._meshes[mesh] = Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)
        return self._meshes[mesh]

    def moved_meshes(self) -> dict[Mesh, Mesh]:
        """Each mesh of the arguments (and of the step's jit) and the mesh it became."""
        return dict(self._meshes)

    def axis_sizes(self, mesh: Mesh) -> dict[str, int]:
        """The size of each of ``mesh``'s axes on the target (the rules: module docstring)."""
        n = len(self.target.devices)
        names = tuple(mesh.axis_names)
        if self.mesh_shape is not None:
            if set(self.mesh_shape) != set(names) or math.prod(self.mesh_shape.values()) != n:
                raise PlacementError(
                    f"mesh_shape {self.mesh_shape} must give every axis of the arguments' mesh {dict(mesh.shape)} "
                    f"a size, the sizes multiplying to the {n} devices of {self.target.name}")
            return {name: self.mesh_shape[name] for name in names}
        if mesh.size == n:
            return dict(mesh.shape)
        largest = max(range(len(names)), key=lambda i: (mesh.shape[names[i]], i))
        return {name: n if i == largest else 1 for i, name in enumerate(names)}

    def sharding(self, sharding: Any, shape: tuple[int, ...], where: str) -> jax.sharding.Sharding:
        """``sharding`` of an array of ``shape`` (``where`` names it in errors), moved."""
        if isinstance(sharding, NamedSharding):  # replicated here or not: its axes may grow there
            mesh = self.mesh(sharding.mesh)
            _check_divides(shape, sharding.spec, mesh, where, self.target.name)
            return NamedSharding(mesh, sharding.spec, memory_kind=_kept_memory(sharding))
        if sharding is None or sharding.is_fully_replicated:
            return self.replicated()
        raise PlacementError(f"{where} is split by a {type(sharding).__name__}, which names no mesh axes to "
                             f"keep on {self.target.name}: place it with a NamedSharding")

    def replicated(self) -> NamedSharding:
        """Every target device, nothing split: on the first mesh moved, so that the device
        order is the other arguments' (else on the target's own mesh)."""
        if self._replicated is None:
            mesh = next(iter(self._meshes.values()), None) or self.target.mesh()
            self._replicated = NamedSharding(mesh, PartitionSpec())
        return self._replicated

    # -- trees, arguments and the step ---------------------------------------------------------
    def leaf(self, x: Any, where: str) -> Any:
        """An array leaf as a ``ShapeDtypeStruct`` on the target's devices; others unchanged."""
        if isinstance(x, jax.Array):
            sharding = x.sharding if x.committed else None
        elif isinstance(x, jax.ShapeDtypeStruct):
            sharding = x.sharding
        elif isinstance(x, np.ndarray):
            sharding = None
        else:
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.sharding(sharding, x.shape, where),
                                    weak_type=getattr(x, "weak_type", False))

    def tree(self, tree: Any, name: str) -> Any:
        return jax.tree_util.tree_map_with_path(lambda path, x: self.leaf(x, name + jax.tree_util.keystr(path)),
                                                tree)

    def arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments of one call of the step, moved. Their meshes are moved first, so that a
        replicated leaf lies on the first of them (one device order, and one mesh where the
        axes are explicit)."""
        for x in jax.tree.leaves((args, kwargs), is_leaf=_is_graph_node):
            for leaf in jax.tree.leaves(_split(x)[1] if _is_graph_node(x) else x):
                sharding = getattr(leaf, "sharding", None)
                if isinstance(sharding, NamedSharding):
                    self.mesh(sharding.mesh)
        nodes = graph_nodes(args)
        out = [a if i in nodes else self.tree(a, f"args[{i}]") for i, a in enumerate(args)]
        if nodes:
            nnx = imported_nnx()
            graphdef, state = _split(tuple(nodes.values()))
            copies = nnx.merge(graphdef, self.tree(state, "(NNX objects)"))
            for i, copy in zip(nodes, copies):
                out[i] = copy
        return tuple(out), {key: self.tree(value, key) for key, value in kwargs.items()}

    def step(self, step_fn: Any) -> Any:
        """``step_fn`` as it compiles for the target: itself, or jitted again where its jit
        names shardings on other devices (see the module docstring)."""
        if not hasattr(step_fn, "lower"):
            raise PlacementError(f"the step must be jitted (jax.jit or nnx.jit, with .lower), got "
                                 f"{type(step_fn).__name__}")
        nnx = imported_nnx()
        if nnx is not None and isinstance(step_fn, nnx.transforms.compilation.JitWrapped):
            if any(s is not None for s in (step_fn.in_shardings, step_fn.out_shardings, step_fn.kwarg_shardings)):
                raise PlacementError("an nnx.jit step with in_shardings/out_shardings names shardings of this "
                                     "machine's devices, which cannot be moved onto the target's: leave them out "
                                     "(the arguments' shardings are kept) or use jax.jit")
            return step_fn
        info = getattr(step_fn, "_jit_info", None)
        if info is None or not _names_shardings(info):
            return step_fn
        return self._rejit(step_fn, info)

    def _rejit(self, step_fn: Any, info: Any) -> Any:
        fun = getattr(step_fn, "_fun", None)
        if fun is None or info.device is not None or info.backend is not None:
            raise PlacementError("this step's jit pins it to this machine (device=/backend=, or a jax version "
                                 "whose jit does not say how it was made): jit it without device/backend and "
                                 "let the arguments carry the shardings")
        if any(x is not None for x in (*info.in_layouts_leaves, *info.out_layouts_leaves)):
            raise PlacementError("this step's jit names layouts of this machine's devices: leave in_shardings/"
                                 "out_shardings layouts out to compile it for another target")

        def moved(treedef, leaves, side):
            return jax.tree_util.tree_unflatten(treedef, [
                self.sharding(s, (), f"the step's {side}[{i}]") if isinstance(s, jax.sharding.Sharding) else s
                for i, s in enumerate(leaves)])

        return jax.jit(fun, in_shardings=moved(info.in_shardings_treedef, info.in_shardings_leaves, "in_shardings"),
                       out_shardings=moved(info.out_shardings_treedef, info.out_shardings_leaves, "out_shardings"),
                       static_argnums=info.static_argnums, static_argnames=info.static_argnames,
                       donate_argnums=info.donate_argnums, donate_argnames=info.donate_argnames,
                       keep_unused=info.keep_unused, inline=info.inline,
                       compiler_options=dict(info.compiler_options_kvs) or None)

    @contextlib.contextmanager
    def lowering(self) -> Iterator[None]:
        """While the step lowers: the mesh ``jax.set_mesh`` set here, moved, if one is set; and
        a step whose body names this machine's devices refused with the fix."""
        current = jax.sharding.get_mesh()
        with contextlib.ExitStack() as stack:
            if current is not None and not current.empty:
                stack.enter_context(jax.set_mesh(self.mesh(current)))
            try:
                yield
            except ValueError as e:
                if "incompatible devices" not in str(e):
                    raise
                raise PlacementError(
                    f"{e}\nThe step's body names shardings of this machine's devices, which cannot be moved onto "
                    f"{self.target.name}'s: name PartitionSpecs under jax.set_mesh (its mesh is moved), or leave the "
                    "placement to the jit's in_shardings/out_shardings (moved too)") from None


def _names_shardings(info: Any) -> bool:
    return any(isinstance(s, jax.sharding.Sharding) for s in (*info.in_shardings_leaves, *info.out_shardings_leaves))


def _kept_memory(sharding: NamedSharding) -> str | None:
    """A memory kind other than the default one (compile-only devices list no memories, and
    "device" is what every array says it lives in)."""
    kind = sharding.memory_kind
    return None if kind in (None, "device") else kind


def _check_divides(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh, where: str, target: str) -> None:
    for dim, axes in enumerate(spec):
        if axes is None or dim >= len(shape):
            continue
        axes = axes if isinstance(axes, tuple) else (axes,)
        ways = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % ways:
            raise PlacementError(
                f"{where} (shape {tuple(shape)}) is split on dimension {dim} by {axes}, {ways} ways on "
                f"{target}'s mesh {dict(mesh.shape)}, which does not divide {shape[dim]}: pass mesh_shape= "
                "(overlap-ckpt aot --mesh-shape) with axis sizes that divide it")


def _is_graph_node(x: Any) -> bool:
    nnx = imported_nnx()
    return nnx is not None and nnx.graphlib.is_graph_node(x)


def _split(nodes: Any) -> tuple[Any, Any]:
    return imported_nnx().split(nodes)
