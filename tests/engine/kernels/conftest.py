"""Kernel tests run the Triton kernels in Triton's interpreter when there is no GPU (CI), on the GPU when
there is one. The variable must be set before a kernel module is imported (at `@triton.jit` time)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _prefill_kernels_on(monkeypatch):
    """Kernel tests test the Triton prefill kernels even where the environment switched them off."""
    monkeypatch.setenv("ENCLAVE_TRITON_PREFILL", "1")
