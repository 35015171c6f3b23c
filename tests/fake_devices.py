"""Fake CUDA devices on a CPU build of torch, for tests of attngeom's GPU path (docs/testing.md).

Under ``torch._subclasses.fake_tensor.FakeTensorMode`` a tensor can live on ``cuda:0`` or
``cuda:1`` without a GPU: every operation computes shapes, dtypes and devices only, and an
operation mixing a ``cuda`` tensor with a ``cpu`` one raises ``FakeTensorDeviceMismatchError``,
as the GPU would. A CPU build cannot enter a CUDA device guard, which Python indexing
(``x[...]``, ``x[...] = y``) and a few tensor methods (``contiguous``, ``copy_``, ``~x``) do;
:func:`fake_cuda` routes them, for fake tensors, through the equivalent aten operations
(``select``, ``slice``, ``unsqueeze``, ``index``, ``index_put_``, ``clone``, ``copy_``,
``bitwise_not``) while it is active.

- :func:`fake_cuda` — the mode (a context manager), with indexing routed.
- :func:`to_fake` — a model's parameters and buffers as fake tensors on a device (bf16 or any
  dtype), or on several devices by a ``device_map`` (``{module name prefix: device}``), with
  accelerate's hooks moving activations between them as ``from_pretrained(device_map=...)`` does.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)

_ORIGINAL = {name: getattr(torch.Tensor, name) for name in ("__getitem__", "__setitem__", "contiguous", "copy_",
                                                             "__invert__")}
_GETITEM, _SETITEM = _ORIGINAL["__getitem__"], _ORIGINAL["__setitem__"]


def _expand(idx, ndim: int) -> list:
    """``idx`` as a list with ``Ellipsis`` replaced by full slices."""
    idx = list(idx) if isinstance(idx, tuple) else [idx]
    consumed = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
                   for i in idx if i is not None and i is not Ellipsis)
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx[k:k + 1] = [slice(None)] * (ndim - consumed)
    return idx


def _basic(x: torch.Tensor, idx) -> tuple[torch.Tensor, list]:
    """Apply ints, slices and None of ``idx`` to ``x`` (a view); return it and the tensor indices
    left for advanced indexing (``None`` at the other dimensions), as aten's ``index`` takes them."""
    out, dim, advanced = x, 0, []
    for i in _expand(idx, x.dim()):
        if i is None:
            out = out.unsqueeze(dim)
            advanced.append(None)
            dim += 1
        elif isinstance(i, bool):
            raise NotImplementedError("boolean scalar index")
        elif isinstance(i, int) or (isinstance(i, torch.Tensor) and i.dim() == 0 and not i.dtype.is_floating_point
                                    and i.dtype != torch.bool and not isinstance(i, FakeTensor)):
            out = out.select(dim, int(i))
        elif isinstance(i, slice):
            n = out.shape[dim]
            start, stop, step = i.indices(n)
            out = torch.ops.aten.slice(out, dim, start, max(start, stop), step)
            advanced.append(None)
            dim += 1
        elif isinstance(i, (torch.Tensor, list)):
            t = torch.as_tensor(i, device=out.device) if isinstance(i, list) else i
            advanced.append(t)
            dim += 1 if t.dtype != torch.bool else t.dim()
        else:
            raise NotImplementedError(f"index {i!r}")
    while advanced and advanced[-1] is None:
        advanced.pop()
    return out, advanced


def _getitem(self, idx):
    if not isinstance(self, FakeTensor):
        return _GETITEM(self, idx)
    out, advanced = _basic(self, idx)
    return torch.ops.aten.index(out, advanced) if advanced else out


def _setitem(self, idx, value):
    if not isinstance(self, FakeTensor):
        return _SETITEM(self, idx, value)
    out, advanced = _basic(self, idx)
    if advanced:
        value = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=out.dtype, device=out.device)
        torch.ops.aten.index_put_(out, advanced, value)
    elif isinstance(value, torch.Tensor):
        torch.ops.aten.copy_(out, value)
    else:
        torch.ops.aten.fill_(out, value)


def _contiguous(self, memory_format=torch.contiguous_format):
    if not isinstance(self, FakeTensor) or self.is_contiguous(memory_format=memory_format):
        return _ORIGINAL["contiguous"](self, memory_format=memory_format)
    return torch.ops.aten.clone(self, memory_format=memory_format)


def _copy_(self, src, non_blocking=False):
    if not isinstance(self, FakeTensor):
        return _ORIGINAL["copy_"](self, src, non_blocking)
    return torch.ops.aten.copy_(self, src, non_blocking)


def _invert(self):
    if not isinstance(self, FakeTensor):
        return _ORIGINAL["__invert__"](self)
    return torch.ops.aten.bitwise_not(self)


_ROUTED = {"__getitem__": _getitem, "__setitem__": _setitem, "contiguous": _contiguous, "copy_": _copy_,
           "__invert__": _invert}


@contextlib.contextmanager
def fake_cuda():
    """A ``FakeTensorMode`` in which ``cuda:0`` and ``cuda:1`` exist (module docstring)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for name, fn in _ROUTED.items():
        setattr(torch.Tensor, name, fn)
    try:
        with mode:
            yield mode
    finally:
        for name, fn in _ORIGINAL.items():
            setattr(torch.Tensor, name, fn)


def to_fake(mode: FakeTensorMode, model: torch.nn.Module, device=CUDA0, dtype=torch.bfloat16,
            device_map: dict[str, torch.device] | None = None) -> torch.nn.Module:
    """Replace ``model``'s parameters (cast to ``dtype``) and buffers by fake tensors on ``device``,
    or on the device of the longest prefix of each module's name in ``device_map``; with a map,
    accelerate's ``AlignDevicesHook`` moves each mapped module's inputs to its device (and the
    model's output back to the first device), as a model loaded with ``device_map`` has."""
    def where(name: str) -> torch.device:
        if not device_map:
            return device
        hits = [p for p in device_map if name == p or name.startswith(p + ".") or p == ""]
        return device_map[max(hits, key=len)] if hits else device

    for name, mod in model.named_modules():
        dev = where(name)
        for k, p in list(mod._parameters.items()):
            if p is not None and not isinstance(p, FakeTensor):
                fake = mode.from_tensor(p.detach().to(dtype if p.is_floating_point() else p.dtype))
                with mode:
                    mod._parameters[k] = torch.nn.Parameter(fake.to(dev), requires_grad=False)
        for k, b in list(mod._buffers.items()):
            if b is not None and not isinstance(b, FakeTensor):
                fake = mode.from_tensor(b)
                with mode:
                    mod._buffers[k] = fake.to(dev)
    if device_map:
        from accelerate.hooks import AlignDevicesHook, add_hook_to_module

        for prefix, dev in device_map.items():
            add_hook_to_module(model.get_submodule(prefix), AlignDevicesHook(execution_device=dev), append=True)
        add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    return model
