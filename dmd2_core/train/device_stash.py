"""Device memory handed back while a trainer sleeps: a set of tensors moved to host memory and
freed, then brought back bit for bit.

Two ways out, for two kinds of tensors:

- a storage that other tensors view (FSDP's parameter shards, module buffers) is copied to the
  host and resized to zero bytes in place, so every view of it stays valid and reads the same
  values again once it is restored;
- a tensor only its holder refers to (EMA, optimizer moments) is swapped for an empty one, the
  holder (a dict, a list, or a DTensor's ``_local_tensor``) later given a fresh device copy.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def distinct_storages(tensors: Iterable[torch.Tensor], device_type: str) -> list[torch.UntypedStorage]:
    """The distinct storages behind ``tensors`` on a device of ``device_type`` (views share one),
    leaving out scalars and empty storages."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if t.device.type == device_type and t.dim() and storage.nbytes():
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def slot(holder, key, value: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Read (or, with ``value``, replace) a tensor held as an attribute of a tensor or as an entry
    of a dict or list."""
    if value is None:
        return getattr(holder, key) if isinstance(holder, torch.Tensor) else holder[key]
    if isinstance(holder, torch.Tensor):
        setattr(holder, key, value)
    else:
        holder[key] = value
    return value


class DeviceStash:
    """Host copies of device tensors whose device memory was freed; ``restore`` puts every value
    back where it was. ``pin``: page-locked host memory (faster copies to and from CUDA)."""

    def __init__(self, pin: bool = False):
        self.pin = pin
        self._swapped: list[tuple] = []  # (holder, key, host copy, device)
        self._resized: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (storage, host bytes)

    def swap_out(self, slots: Iterable[tuple]) -> None:
        """Each (holder, key)'s tensor is copied to the host and replaced by an empty one."""
        for holder, key in slots:
            value = slot(holder, key)
            self._swapped.append((holder, key, _host_copy(value, self.pin), value.device))
            slot(holder, key, value.new_empty(0))

    def resize_out(self, storages: Iterable[torch.UntypedStorage]) -> None:
        """Each storage is copied to the host and resized to zero bytes in place."""
        for storage in storages:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.pin)
            host.untyped_storage().copy_(storage)
            storage.resize_(0)
            self._resized.append((storage, host))

    def restore(self) -> None:
        """Every resized storage and swapped tensor back on its device, with its saved bytes."""
        for storage, host in self._resized:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage())
        for holder, key, host, device in self._swapped:
            slot(holder, key, host.to(device, copy=True))
        self._swapped, self._resized = [], []


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t)
    return host
