"""A stand-in for a GPU on a machine without one, for tests/test_stand_in_device.py: the model's tensors on torch's
`meta` device (shapes and dtypes, no values) with the GPU's code paths taken there (engine.gpu_paths.emulated), the
host's tensors on the CPU, as on a GPU machine.

What a GPU would do is checked as it runs: an operation given a device tensor and a host tensor (other than a 0-dim
one, which CUDA takes as a number) raises at once, naming the operation, as CUDA's "Expected all tensors to be on the
same device" would; each read of a device value by the host (`.item()`, `float()`, `bool()`, `.cpu()`, `.tolist()`,
a copy to the host, `nonzero`, a boolean index) is counted under the phase running (`StandIn.reads`), and answered
with zeros (all rows alive, nothing masked), since a meta tensor holds no value. Shapes and dtypes are meta's own:
a shape error raises as it would on the GPU.
"""

import collections
import contextlib
import functools

import torch
import torch.utils._foreach_utils as foreach_utils
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench import census
from engine import gpu_paths


class HostTensorOnTheDevice(RuntimeError):
    """An operation mixed the device's tensors with a host tensor: on a GPU, a device mismatch (or a hidden copy)."""


def _tensors(value):
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class StandIn(TorchDispatchMode):
    """Counts the host's reads of device values per phase (`labelled`) and refuses host tensors next to device ones."""

    def __init__(self):
        super().__init__()
        self.reads = collections.Counter()   # (phase, kind) -> reads
        self.phase = "other"

    labelled = census.Census.labelled   # a phase for the block, as bench census labels its records

    def label(self, phase, function):
        """`function` with its reads counted under `phase`."""
        return functools.wraps(function)(census.label(self, phase, function))

    def read(self, kind):
        self.reads[self.phase, kind] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        tensors = _tensors((args, kwargs))
        if not any(t.device.type == "meta" for t in tensors):
            return func(*args, **kwargs)
        host = [t for t in tensors if t.device.type != "meta" and t.dim() > 0]
        target = kwargs.get("device")
        if name in ("_to_copy", "to") and target is not None and torch.device(target).type != "meta":
            self.read("copy to the host")
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=target)
        if name == "copy_" and args[0].device.type != "meta":
            self.read("copy to the host")
            return args[0].zero_()
        if host and name not in ("_to_copy", "copy_"):
            raise HostTensorOnTheDevice(f"{func} was given host tensors {[tuple(t.shape) for t in host]} with the "
                                        "device's")
        if name == "_local_scalar_dense":
            self.read("item")
            return False if args[0].dtype == torch.bool else 0.0 if args[0].dtype.is_floating_point else 0
        if name in ("nonzero", "argwhere"):
            self.read("nonzero")
            return torch.empty(args[0].numel(), args[0].dim(), dtype=torch.long, device="meta")
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.read("boolean index")
            return self.boolean_index(args[0], args[1])
        return func(*args, **kwargs)

    @staticmethod
    def boolean_index(tensor, indices):
        """tensor[indices] with every mask taken as all True (the shape a GPU gives when nothing is masked)."""
        shape, dim = [], 0
        for index in indices:
            if index is None:
                shape.append(tensor.shape[dim])
                dim += 1
            elif index.dtype == torch.bool:
                shape.append(index.numel())
                dim += index.dim()
            else:
                shape.extend(index.shape)
                dim += 1
        return tensor.new_empty(*shape, *tensor.shape[dim:])


@contextlib.contextmanager
def stand_in_gpu(**card):
    """For the block: the GPU paths taken on `meta` (gpu_paths.emulated("meta", **card)), torch's multi-tensor
    (foreach) kernels allowed there as on CUDA, and a StandIn recording: yields it."""
    supported = foreach_utils._get_foreach_kernels_supported_devices
    foreach_utils._get_foreach_kernels_supported_devices = lambda: [*supported(), "meta"]
    recorder = StandIn()
    try:
        with gpu_paths.emulated("meta", **card), recorder:
            yield recorder
    finally:
        foreach_utils._get_foreach_kernels_supported_devices = supported
