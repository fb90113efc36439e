"""What the cyclic GC would have to free: the check that a request path leaves no cycles."""

from __future__ import annotations

import gc
import inspect

from sim.gpu_model import SimJob


def free_unreachable() -> None:
    """Free what only the cyclic GC could free now: what came before a check."""
    gc.collect()


def unreachable_now() -> list[object]:
    """Every object only the cyclic GC could free now. Listed, not freed: the cycles are
    still there after the call (``free_unreachable`` frees them)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def request_leftovers(objects: list[object]) -> list[str]:
    """The names of the types among ``objects`` that a finished request left: its
    jobs, errors and the frames their tracebacks hold."""
    return sorted(
        {
            type(o).__name__
            for o in objects
            if isinstance(o, SimJob | BaseException) or inspect.isframe(o)
        }
    )
