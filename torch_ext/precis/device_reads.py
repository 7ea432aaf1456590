"""The one way a step reads a tensor's value back to the host (read), counted, and the
switch that sends CPU tensors down the path a GPU's take (device_path).

On a GPU each read waits for the device to finish everything queued before it, so a
step that reads nothing can run ahead of its kernels. Every read on the step path goes
through read() (tests/py/ops/test_device_path.py scans the sources for others and counts
these per step). PRECIS_DEVICE_PATH_ON_CPU=1 in the environment makes a step of CPU
tensors take a GPU step's path (fingerprints by torch.ops.precis.fingerprint as
tensors, verdicts as tensors, none of the CPU's shortcuts), so that its reads and op
calls can be counted and tested without a GPU; it is read at every step (a Plan keeps
the path it was made on: step_plan.make_part)."""

import os
from collections import Counter

import torch

# why -> reads so far (read's `why`); tests take differences around a step
counts = Counter()


def emulated():
    """Whether CPU tensors take the device path (PRECIS_DEVICE_PATH_ON_CPU=1)."""
    return os.environ.get("PRECIS_DEVICE_PATH_ON_CPU") == "1"


def device_path(device):
    """Whether tensors on `device` (a torch.device) take the device path: off the
    CPU, or on it when emulated()."""
    return device.type != "cpu" or emulated()


def compares_on_device(device):
    """Whether a step on `device` (on the device path) compares the params' fingerprints
    and resyncs the masters on the device, reading nothing back (the default;
    PRECIS_COMPARE_ON_DEVICE=0, read at every step, compares on the host instead,
    reading two int64s a param back: the path before the resync kernel,
    precis.resync_masters_, whose blocks return at once for a param not written)."""
    return device_path(device) and os.environ.get("PRECIS_COMPARE_ON_DEVICE") != "0"


def read(tensor, why):
    """tensor's values on the host (Tensor.tolist()), counted under `why` when the
    read would wait for a device (a tensor on the device path)."""
    if device_path(tensor.device):
        counts[why] += 1
    return tensor.tolist()


def flag(tensor, why):
    """Whether a one-element flag (found_inf: nonzero when set) is set, counted as read()."""
    return number(tensor, why) != 0.0


def number(value, why):
    """A float from a number or a one-element tensor, counted as read()."""
    if isinstance(value, torch.Tensor) and device_path(value.device):
        counts[why] += 1
    return float(value)


def read_numbers(values, why):
    """values with each tensor (one element each) as a float: one read a device (one cat,
    counted as read() under `why`), the rest (floats, strings) as they are."""
    out = list(values)
    by_device = {}
    for i, v in enumerate(out):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for places in by_device.values():  # (one cat, one conversion: two launches a
        # device, not one a value; cat promotes float32 flags beside a float64 norm to
        # float64, exactly; a flag has one dimension already, a norm none)
        numbers = read(torch.cat([out[i] if out[i].dim() == 1 else out[i].reshape(1)
                                  for i in places]).double(), why)
        if len(numbers) != len(places):
            raise RuntimeError(f"{why}: {len(places)} values of one element each expected, "
                               f"got {len(numbers)} elements")
        for i, value in zip(places, numbers):
            out[i] = value
    return out


class Later:
    """A tensor's values copied to the host without waiting for them (on a GPU into
    pinned memory, a non-blocking copy and an event), read once the copy is done."""

    def __init__(self, tensor):
        self._event = None
        if tensor.is_cuda:
            # (a non-blocking copy to the CPU allocates its output pinned: one op call)
            self._host = tensor.to("cpu", non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.clone()

    def ready(self):
        """Whether the copy is done (reading it waits for nothing)."""
        return self._event is None or self._event.query()

    def values(self, why):
        """The values (a list), waiting for the copy if it is not done (a read,
        counted under `why`)."""
        if not self.ready():
            counts[why] += 1
            if self._event is not None:
                self._event.synchronize()
        return self._host.tolist()


def total():
    """Every read counted so far."""
    return sum(counts.values())
