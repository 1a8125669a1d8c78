"""Parameter sets for the kernel tests that cover every pair of values instead of every combination.

Under Triton's interpreter each program runs in Python, so a case costs seconds and the full product of
sizes, head layouts, dtypes and tilings costs minutes while adding no code path: a kernel's branches hang on
one value (a masked tile, a constexpr) or on two meeting (a head count with a tile width), rarely on three.
Also `captured`, the gpu tests' CUDA-graph capture of a kernel call.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch


def crossed(first: Sequence, second: Sequence, *cycled: Sequence) -> list:
    """Every (a, b) of `first` x `second` (the two axes whose values meet in the kernel), each with one value
    of every `cycled` axis, taken in turn; then, for any two values of two axes that met in no case, one case
    more. So every pair of values meets, of any two axes."""
    axes = [first, second, *cycled]
    cases = [
        [a, b, *(axis[(i + j) % len(axis)] for axis in cycled)]
        for (i, a), (j, b) in itertools.product(enumerate(first), enumerate(second))
    ]
    for x, y in itertools.combinations(range(len(axes)), 2):
        for u, v in itertools.product(axes[x], axes[y]):
            if not any(case[x] == u and case[y] == v for case in cases):
                extra = list(cases[0])
                extra[x], extra[y] = u, v
                cases.append(extra)
    return [pytest.param(*case, id="-".join(ids(v) for v in case)) for case in cases]


def ids(value: Any) -> str:
    """Readable test ids (`ids=cases.ids`): `float16` for a dtype, `2x4x16` for a tuple."""
    if isinstance(value, tuple):
        return "x".join(ids(v) for v in value)
    return str(value).removeprefix("torch.")


def captured(block: Callable[[], Any]) -> tuple[Any, Any]:
    """(graph, its static output): `block` run once eagerly (its kernels compile outside the capture), then
    captured in a CUDA graph. The gpu tests' replay checks copy new inputs in and call `graph.replay()`."""
    block()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block()
    return graph, out
