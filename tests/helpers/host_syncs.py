"""Counting, on a CPU, the calls that would make the host wait for the GPU: inside ``with HostSyncCounter() as
syncs:``, ``syncs.calls`` counts them by kind and call site (the first frame outside torch).

What counts (torch's own hooks see every call, DeepSpeed's included: a ``TorchFunctionMode`` for the Python-level
calls, a ``TorchDispatchMode`` for the operators):
- reading a value on the host: ``item``, ``bool()``/``int()``/``float()``/``index()`` of a tensor, ``tolist``,
  ``numpy``, ``cpu``, and the scalar reads operators make internally (``aten._local_scalar_dense``);
- operators whose output size depends on the data (``nonzero``, ``masked_select``, ``unique``, ...);
- copies from pageable host memory to the device: ``torch.tensor``/``torch.as_tensor`` with a device, and
  ``.to(device)`` of a host tensor without ``non_blocking=True``.

On a CPU every tensor is on the CPU, so "host tensor" means what would stay on the host of a GPU machine: one made
by ``torch.tensor``/``torch.as_tensor`` without a device or by ``torch.from_numpy``, until ``.to(device)`` moves it.
Reading a host tensor (the stop agreement over a CPU process group) waits for nothing and does not count.
"""

from __future__ import annotations

import os
import traceback
import weakref
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter"]

_HOST_READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
               torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
_FROM_HOST_VALUES = {torch.tensor, torch.as_tensor}
_DATA_DEPENDENT = {"aten.nonzero", "aten.masked_select", "aten._unique", "aten._unique2", "aten.unique_dim",
                   "aten.unique_consecutive", "aten.repeat_interleave"}
_TORCH_DIR = os.path.dirname(torch.__file__)


def _call_site() -> str:
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            return f"{'/'.join(frame.filename.split(os.sep)[-2:])}:{frame.lineno} {frame.name}"
    return "?"


class HostSyncCounter:
    """The calls that would synchronize a GPU with its host, counted by ``(kind, call site)`` in ``calls``."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self._host: dict[int, weakref.ref] = {}  # by id: a WeakSet compares tensors with ==, element-wise
        self._reading = 0
        self._modes = (_FunctionHook(self), _DispatchHook(self))

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        self._from_numpy = torch.from_numpy
        torch.from_numpy = self._host_from_numpy  # torch's modes do not see it (an ignored function)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.from_numpy = self._from_numpy
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def _host_from_numpy(self, array: Any) -> torch.Tensor:
        tensor = self._from_numpy(array)
        self._host[id(tensor)] = weakref.ref(tensor)
        return tensor

    def _function(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _HOST_READS:
            if not (args and self._is_host(args[0])):
                self.calls[(func.__name__, _call_site())] += 1
            self._reading += 1  # the operator underneath (_local_scalar_dense) is this same read
            try:
                return func(*args, **kwargs)
            finally:
                self._reading -= 1
        result = func(*args, **kwargs)
        if func in _FROM_HOST_VALUES and kwargs.get("device") is None:
            self._host[id(result)] = weakref.ref(result)
        elif func in _FROM_HOST_VALUES:
            self.calls[(f"{func.__name__}(device=...)", _call_site())] += 1
        elif func is torch.Tensor.to and args and self._is_host(args[0]) and _names_device(args[1:], kwargs):
            if not kwargs.get("non_blocking"):
                self.calls[("to(device) from the host", _call_site())] += 1
            self._host.pop(id(result), None)  # on the device now (on a CPU, .to may return the same tensor)
        return result

    def _is_host(self, value: object) -> bool:
        held = self._host.get(id(value))
        return held is not None and held() is value

    def _operator(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = str(func.overloadpacket)
        if (name == "aten._local_scalar_dense" and not self._reading) or name in _DATA_DEPENDENT:
            self.calls[(name, _call_site())] += 1
        return func(*args, **kwargs)


def _names_device(args: tuple, kwargs: dict) -> bool:
    return "device" in kwargs or any(isinstance(arg, torch.device | str) for arg in args)


class _FunctionHook(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.counter._function(func, args, kwargs or {})


class _DispatchHook(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.counter._operator(func, args, kwargs or {})
