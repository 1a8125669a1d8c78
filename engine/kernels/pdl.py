"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step is a chain of ~540 short dependent kernels (a CUDA graph at batch 1 runs them in ~3 ms), and
between two of them the GPU idles while the second is launched and its programs start: ~1.3 us per kernel
boundary measured in one graphed DeltaNet layer on an H200 (46.3 us for 8 launches whose kernels add up to
~36 us). With PDL a kernel may be launched while the one before it is still running; its programs then
wait (`griddepcontrol.wait`) until that kernel has completed and its writes are visible, so the launch and
start-up overlap the previous kernel's tail instead of following it.

The rule that keeps this correct: a kernel launched with `pdl_launch()` calls `pdl_wait(PDL)` before it
touches memory. Its wait returns only once the previous kernel completed, and that kernel completed only
after its own wait returned, so everything earlier in the stream is complete too. Kernels not launched this
way (cuBLAS, torch ops) keep the ordinary stream order, before and after. After its wait a kernel lets the
next one launch at once (`griddepcontrol.launch_dependents`): the next kernel's programs take free SM slots
and wait there. CUDA graph capture keeps these as programmatic edges (CUDA 12.3 and later).

On by default on CUDA devices of compute capability 9.0 and later with a Triton that has the launch option;
ENCLAVE_PDL=0 turns it off. Never under Triton's interpreter (the instructions do not exist there: with
PDL False, `pdl_wait` is compiled out).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.env import engine_env

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None


def pdl_enabled() -> bool:
    """Whether kernels launch with PDL now: a capable GPU and Triton, no interpreter, no ENCLAVE_PDL=0."""
    env = engine_env()
    return env.pdl and not env.triton_interpret and _supported()


@functools.cache
def _supported() -> bool:
    if gdc_wait is None or not torch.cuda.is_available():
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - not an NVIDIA build of Triton
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability()[0] >= 9


def pdl_launch() -> dict:
    """Keyword arguments for a kernel launch: the kernel's PDL constexpr and, when on, Triton's launch_pdl."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled() else {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """The first statement of a kernel launched with `pdl_launch()`: wait for the previous kernel to complete
    (its writes visible), then let the next kernel launch. Nothing when PDL is False."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
