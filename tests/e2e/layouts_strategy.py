"""Hypothesis strategies for :class:`e2e.layouts.Case`: a job's process count and devices,
a 1-D or 2-D mesh over them, a valid ``PartitionSpec`` per leaf drawn independently for the
parameters and every optimizer-state leaf, the chain, how the state is created and how the
step is jitted."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from e2e.layouts import CHAINS, CREATES, STEPS, Case, leaf_shapes

JOBS = ((2, 1), (2, 2), (4, 1))  # (processes, CPU devices per process)


def _meshes(devices: int) -> list[tuple[int, ...]]:
    return [(devices,)] + [(a, devices // a) for a in range(2, devices) if devices % a == 0]


@st.composite
def spec_for(draw, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list:
    """A valid spec for ``shape``: each mesh axis used at most once, each dimension split
    into a number of blocks that divides it."""
    sizes = dict(zip(("a", "b"), mesh_shape))
    free = list(sizes)
    spec = []
    for n in shape:
        options = [()] + [combo for r in (1, 2) for combo in itertools.permutations(free, r)
                          if n % _product(sizes[a] for a in combo) == 0]
        combo = draw(st.sampled_from(options))
        free = [a for a in free if a not in combo]
        spec.append(None if not combo else combo[0] if len(combo) == 1 else list(combo))
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@st.composite
def cases(draw) -> tuple[Case, int, int]:
    """``(case, processes, devices per process)``."""
    nprocs, devices = draw(st.sampled_from(JOBS))
    mesh_shape = draw(st.sampled_from(_meshes(nprocs * devices)))
    chain = draw(st.sampled_from(CHAINS))
    param_shapes, opt_shapes = leaf_shapes(chain)
    param_specs = tuple(draw(spec_for(s, mesh_shape)) for s in param_shapes)
    opt_specs = tuple(draw(spec_for(s, mesh_shape)) for s in opt_shapes)
    case = Case(mesh_shape, param_specs, opt_specs, chain=chain, create=draw(st.sampled_from(CREATES)),
                step=draw(st.sampled_from(STEPS)), replicas=draw(st.sampled_from((0, 1))))
    return case, nprocs, devices
