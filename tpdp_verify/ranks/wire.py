"""How a rank's answer crosses the pipe to the parent: pickle, with plain CPU tensors sent as
their storage's bytes.

pickle sends a tensor through ``torch.save`` of its storage, about 50 microseconds a tensor
each way; an observation holds hundreds of small tensors (each value, gradient and optimizer
state a step, with the index of its elements), so at four ranks the parent spent a quarter of
a training search unpickling while the ranks waited (docs/performance.md). Here a dense CPU
tensor goes as its storage's bytes (once a storage: tensors that share one still share it
when loaded) with its dtype, shape, stride and offset: the same values, layout and sharing,
loaded by plain ``pickle.loads``. Anything else (a subclass, a tensor that requires grad,
quantized, sparse, conjugated or negated by a bit) goes as pickle sends it.
"""

from __future__ import annotations

import io
import pickle

import torch


def dumps(obj) -> bytes:
    """``pickle.dumps(obj)``, each plain dense CPU tensor in it sent as its storage's bytes."""
    out = io.BytesIO()
    _Pickler(out).dump(obj)
    return out.getvalue()


def storage_tensor(data: bytearray, dtype: torch.dtype, shape: tuple, stride: tuple, offset: int) -> torch.Tensor:
    """The tensor ``dumps`` sent: a view of ``data`` (its storage's bytes, shared by every
    tensor that shared the storage) with the layout it had."""
    size = len(data) // dtype.itemsize
    base = torch.frombuffer(data, dtype=dtype, count=size) if size else torch.empty(0, dtype=dtype)
    return base.as_strided(shape, stride, offset)


class _Pickler(pickle.Pickler):
    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._storages: dict[int, bytearray] = {}  # data_ptr -> its bytes, alive while the dump is

    def reducer_override(self, obj):
        if not _sent_as_bytes(obj):
            return NotImplemented
        storage = obj.untyped_storage()
        data = self._storages.get(storage.data_ptr()) if storage.nbytes() else bytearray()
        if data is None:
            data = bytearray(torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes())
            self._storages[storage.data_ptr()] = data  # one object: pickle's memo sends it once
        return storage_tensor, (data, obj.dtype, tuple(obj.shape), obj.stride(), obj.storage_offset())


def _sent_as_bytes(obj) -> bool:
    return (type(obj) is torch.Tensor and obj.layout == torch.strided and obj.device.type == "cpu"
            and not (obj.requires_grad or obj.is_quantized or obj.is_conj() or obj.is_neg()))
