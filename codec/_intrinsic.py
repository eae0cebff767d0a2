"""numba's @intrinsic, typed for the type checker as compiled code calls it.

An intrinsic is defined as `f(typingctx, *args)` and called from kernels as `f(*args)`: numba
supplies the typing context. mypy sees only the definition, so every call looked one argument short.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numba.extending import intrinsic


def typed_intrinsic(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`numba.extending.intrinsic(fn)`, unchanged, typed as a callable of the kernel-side arguments."""
    return intrinsic(fn)
