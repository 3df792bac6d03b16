"""What the host may replay one slice at a time: the primitive tables behind every decision.

Why a module of its own: these tables are the *policy* of slice replay, and the only place
to edit when an optax transform uses a primitive that is not listed yet. Everything else
(:mod:`.interp`, the labelling interpreter) is mechanism.

The rules, in words:

* an **elementwise** primitive keeps every output element a function of the same element
  of each operand, so a row chunk of a leaf stays independent of the other rows;
* broadcasting a scalar onto a leaf (a learning rate) is elementwise too;
* a **call** primitive wraps a sub-program run once with the same operands: it is inlined,
  which keeps the arithmetic identical and exposes the global scalars inside it;
* a rank-0 value computed from leaf data by anything else is a **global scalar** (a norm,
  a finite flag, a trust ratio): recorded on the device, injected on the host. So is scalar
  arithmetic on a global scalar (``mean`` divides a sum by the leaf's size, a constant that
  differs between the device's whole leaf and the host's chunk);
* everything else reduces within a leaf, so the leaf must be replayed whole.
"""

from __future__ import annotations

import numpy as np

ELEMENTWISE_PRIMITIVES = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "conj", "convert_element_type", "copy", "copy_p", "cos",
    "cosh", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge",
    "gt", "imag", "integer_pow", "is_finite", "le", "lgamma", "digamma", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or",
    "population_count", "pow", "real", "reduce_precision", "rem", "round", "rsqrt",
    "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign",
    "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh", "xor", "stop_gradient",
    "optimization_barrier",
})

# Call primitive -> the name of its parameter that holds the sub-program.
CALL_JAXPR_PARAM = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr",
}


def is_elementwise(primitive: str, operand_shapes: list[tuple[int, ...]]) -> bool:
    """True when ``primitive`` applied to operands of these shapes is elementwise."""
    if primitive in ELEMENTWISE_PRIMITIVES:
        return True
    if primitive == "broadcast_in_dim":
        return int(np.prod(operand_shapes[0])) == 1
    return False


def is_global_scalar(output_shapes: list[tuple[int, ...]], from_leaf_data: bool, elementwise: bool,
                     from_global: bool) -> bool:
    """True when outputs of these shapes must be recorded on the device and injected on the
    host. Only rank-0 values qualify, so that the sequence of global scalars is the same
    when the host's leaves are chunks or one-row stand-ins."""
    rank0 = all(len(s) == 0 for s in output_shapes)
    return rank0 and (from_global or (from_leaf_data and not elementwise))


def escapes_as_size_one(output_shapes: list[tuple[int, ...]], from_global: bool) -> bool:
    """A size-1 but not rank-0 value computed from a global scalar (``keepdims=True``)
    would slip past :func:`is_global_scalar`; it is treated as a within-leaf reduction."""
    return from_global and all(int(np.prod(s)) == 1 for s in output_shapes)
