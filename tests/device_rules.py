"""Apple's MPS rule, checked where a GPU is: no float64 tensor on a device other than the CPU.

MPS has no float64; a script that makes one there stops. Where the tests have no Mac, the same
rule can be held on CUDA: `NoFloat64OnDevice` is a dispatch mode that sees every operator's
outputs (factories such as `torch.zeros(..., dtype=float64, device=...)`, `.double()`, `.to()`
and arithmetic alike) and raises at the first float64 tensor on a non-CPU device, naming the
operator. Python floats and float64 on the CPU are allowed, as on a Mac.

Used by tests/test_devices.py.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Float64OnDevice(RuntimeError):
    """A float64 tensor was made on a device that is not the CPU."""


class NoFloat64OnDevice(TorchDispatchMode):
    """Within `with NoFloat64OnDevice():`, a float64 tensor on a non-CPU device raises."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if (isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float64
                    and tensor.device.type != "cpu"):
                raise Float64OnDevice(f"{func} made a float64 tensor on {tensor.device} "
                                      "(Apple's MPS has no float64)")
        return out
