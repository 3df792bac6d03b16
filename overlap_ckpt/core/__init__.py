"""The framework-free algorithm, in data-path order.

``schedule`` (which step is in which window) -> ``interp`` + ``rules`` -> ``separability``
(what may be replayed per slice) -> ``slicing`` -> ``plan`` (the static capture plan) ->
``capture`` / ``fallback`` (device side) -> ``scalars`` (the global-scalar wire format) ->
``buffers`` + ``replay`` (host side) -> ``engine`` (the worker that hands host copies to a
sink). Nothing here knows Flax, NNX or the storage format.
"""

from .plan import CapturePlan, make_plan
from .schedule import WindowSchedule

__all__ = ["CapturePlan", "make_plan", "WindowSchedule"]
