"""What every Triton kernel launch of this package checks first."""

from __future__ import annotations

import os

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _probe():
    pass


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1 as
    triton was first imported, decided per @triton.jit at decoration): then
    they take CPU tensors."""
    return isinstance(_probe, InterpretedFunction)


def check_tensors(*tensors: torch.Tensor) -> None:
    """Raises ValueError unless the tensors share a device the kernels can run on."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")
    if next(iter(devices)).type == "cpu" and not interpreted():
        raise ValueError(
            "Triton kernels got CPU tensors: they need CUDA tensors, or TRITON_INTERPRET=1 set before "
            f"triton is first imported (it is {os.environ.get('TRITON_INTERPRET')!r})"
        )
