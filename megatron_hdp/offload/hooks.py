"""OffloadManager: selective offloading of saved activations per micro-batch (ops layer).

ByteScale's `act_ctx` (section 3.3), built on `torch.autograd.graph.saved_tensors_hooks`:

- `install(layers)` hooks each transformer layer's forward pass, so that while layer `i`
  runs, a saved-tensors-hooks context for layer `i` is active (only inside a
  `micro_batch` context; otherwise the hooks do nothing).
- `with manager.micro_batch(ratio):` sets the micro-batch's offload ratio (from the plan).
  Its forward pass must run inside the context; its backward pass may run inside or
  after it (the saved tensors remember their micro-batch).

Which saved tensors count (per micro-batch, each device storage once):
- Skipped entirely (not activations): parameters, buffers and views of them, found by
  storage `data_ptr` against the hooked layers' parameters and buffers; non-strided
  tensors and tensor subclasses (returned to autograd untouched, not counted).
- `requires_grad` is deliberately NOT a criterion: tensors saved inside an
  `autograd.Function` (e.g. `hdp_attention`'s transposed q, output and lse) do not
  require grad but are some of the largest activations.
- Offloadable: a storage first saved in layers `0 .. num_layers-3` (the last two layers
  stay resident: the one computing and a staging buffer, Eq. 3's `2 * Act`), of at least
  `min_offload_bytes` (default 64 KiB; smaller ones cost a copy launch for nothing),
  covered by a contiguous tensor of the storage's dtype (the saved tensor or its `_base`),
  not conjugate/negative-bit views. Everything else saved in a hooked layer stays
  resident and is counted.

How much (token-level, as in ByteScale): of an offloadable storage's covering tensor with
`n0` rows along dim 0 (tokens for Megatron's `[s, b, h]` and THD layouts; for other
layouts the same byte share rounded to whole rows), the first `ceil(ratio * n0)` rows go
to the engine and the remaining rows are cloned into a new device tensor, so the original
storage can be freed. In the backward pass `unpack` concatenates the fetched rows and the
kept rows (bitwise the original values) and rebuilds the saved view with `as_strided`.
Several saved views of one storage share one copy.

Host memory: the engine holds its host budget from construction on (one pool). When an
offload does not fit the pool's free blocks (`HostPoolExhaustedError`), the storage stays on
the device, counted as resident and in `num_refused`/`bytes_refused`; the manager logs a
warning for the first micro-batch that keeps one (and the total so far every 100 such
micro-batches). The step stays exact; only its device memory is higher.

Prefetch: when the backward pass first unpacks a tensor of layer `i`, the offloaded
tensors of layer `i` (if not yet) and of layer `i - 1` are prefetched.

Accounting (`stats()`, reset per micro-batch): `resident_bytes` is the device bytes held
by saved activations of hooked layers (each storage once, kept rows and fetched copies
included); `peak_resident_bytes` is its maximum during the forward pass; bytes moved each
way; `saved_bytes` (all counted storages) and `offloadable_bytes` (the ratio's base).
Without frees during the forward pass, `peak_resident_bytes == saved_bytes - bytes_to_host`.
"""

from __future__ import annotations

import itertools
import logging
import math
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.hooks import RemovableHandle

from megatron_hdp.offload.engines import CopyEngine, HostPoolExhaustedError

logger = logging.getLogger(__name__)

DEFAULT_MIN_OFFLOAD_BYTES = 64 * 1024
NUM_RESIDENT_LAYERS = 2


def offloaded_rows(ratio: float, rows: int) -> int:
    """`ceil(ratio * rows)`, guarded against float noise (0.1 * 30 is 3, not 4)."""
    return min(rows, math.ceil(round(ratio * rows, 9)))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _covering_tensor(tensor: torch.Tensor, storage_nbytes: int) -> torch.Tensor | None:
    """The saved tensor or its base if it is contiguous over the whole storage, same dtype."""
    for cand in (tensor, tensor._base):
        if (
            cand is not None
            and cand.dtype == tensor.dtype
            and cand.dim() >= 1
            and cand.storage_offset() == 0
            and cand.is_contiguous()
            and _nbytes(cand) == storage_nbytes
        ):
            return cand
    return None


class _ResidentRecord:
    """A storage kept on the device, counted once however many saved views use it."""

    __slots__ = ("batch", "key", "nbytes", "refs")

    def __init__(self, batch: MicroBatchOffload, key: StorageWeakRef, nbytes: int) -> None:
        self.batch, self.key, self.nbytes, self.refs = batch, key, nbytes, 0

    def unref(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            if self.batch._resident.get(self.key) is self:
                del self.batch._resident[self.key]
            self.batch._add_resident(-self.nbytes)


class _OffloadRecord:
    """A storage whose first rows live in the engine and the other rows in `keep`."""

    __slots__ = (
        "batch",
        "key",
        "handle",
        "keep",
        "full",
        "dtype",
        "full_geometry",
        "device_bytes",
        "refs",
        "version",
    )

    def __init__(
        self,
        batch: MicroBatchOffload,
        key: StorageWeakRef,
        base: torch.Tensor,
        handle: int,
        keep: torch.Tensor | None,
    ) -> None:
        self.batch, self.key, self.handle, self.keep = batch, key, handle, keep
        self.full: torch.Tensor | None = None
        self.dtype = base.dtype
        self.full_geometry = (tuple(base.shape), tuple(base.stride()), 0)
        self.device_bytes = 0 if keep is None else _nbytes(keep)
        self.refs = 0
        self.version = base._version  # views share their base's version counter

    def materialize(self) -> torch.Tensor:
        """The whole storage's covering tensor on the device (fetched once, then cached)."""
        if self.full is None:
            batch = self.batch
            fetched = batch.engine.fetch(self.handle)
            batch.engine.release(self.handle)
            self.handle = None
            batch.bytes_to_device += _nbytes(fetched)
            with torch.no_grad():
                full = fetched if self.keep is None else torch.cat([fetched, self.keep])
            self.keep, self.full = None, full
            batch._add_resident(_nbytes(full) - self.device_bytes)
            self.device_bytes = _nbytes(full)
        return self.full

    def unref(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            batch = self.batch
            if self.handle is not None:
                batch.engine.release(self.handle)
                self.handle = None
            if batch._offloaded.get(self.key) is self:
                del batch._offloaded[self.key]
            batch._add_resident(-self.device_bytes)
            self.keep = self.full = None
            self.device_bytes = 0


class _Resident:
    """Pack result of a saved tensor kept on the device."""

    __slots__ = ("tensor", "version", "layer", "record")

    def __init__(self, tensor: torch.Tensor, layer: int, record: _ResidentRecord) -> None:
        self.tensor, self.version, self.layer, self.record = tensor, tensor._version, layer, record
        record.refs += 1

    def unpack(self) -> torch.Tensor:
        self.record.batch._start_backward_of(self.layer)
        if self.tensor._version != self.version:
            # saved_tensors_hooks switch autograd's own check off; keep its guarantee.
            raise RuntimeError(
                "a tensor saved for backward was modified in place after it was saved "
                f"(version {self.version}, now {self.tensor._version}) in layer {self.layer}"
            )
        return self.tensor

    def __del__(self) -> None:
        self.record.unref()


class _Offloaded:
    """Pack result of a saved tensor whose storage was (partly) offloaded.

    Holds only a weak reference to the saved tensor (a strong one would keep the storage
    on the device), enough to repeat autograd's in-place check while the tensor lives.
    """

    __slots__ = ("record", "layer", "geometry", "tensor_ref", "version")

    def __init__(
        self, record: _OffloadRecord, layer: int, geometry: tuple | None, tensor: torch.Tensor
    ) -> None:
        self.record, self.layer, self.geometry = record, layer, geometry
        self.tensor_ref, self.version = weakref.ref(tensor), tensor._version
        record.refs += 1

    def unpack(self) -> torch.Tensor:
        self.record.batch._start_backward_of(self.layer)
        tensor = self.tensor_ref()
        if tensor is not None and tensor._version != self.version:
            raise RuntimeError(
                "a tensor saved for backward was modified in place after it was saved "
                f"(version {self.version}, now {tensor._version}) in layer {self.layer}; its "
                "saved copy was offloaded"
            )
        full = self.record.materialize()
        return full if self.geometry is None else full.as_strided(*self.geometry)

    def __del__(self) -> None:
        self.record.unref()


def _unpack(packed: Any) -> torch.Tensor:
    return packed if isinstance(packed, torch.Tensor) else packed.unpack()


class MicroBatchOffload:
    """Offload state and counters of one micro-batch (made by `OffloadManager.micro_batch`).

    Attributes:
        offload_ratio: Fraction of rows offloaded from each offloadable storage.
        saved_bytes: Device bytes of distinct storages saved by the hooked layers.
        offloadable_bytes: The part of `saved_bytes` eligible for offloading.
        bytes_to_host: Bytes this micro-batch sent to the engine.
        bytes_to_device: Bytes this micro-batch fetched back.
        resident_bytes: Device bytes held by its saved activations now.
        peak_resident_bytes: Largest `resident_bytes` during the forward pass.
        num_offloaded: Storages offloaded.
        num_prefetched: Prefetches issued.
        num_refused: Storages kept on the device because the host pool had no room.
        bytes_refused: Bytes those storages would have sent to the engine.
    """

    def __init__(
        self,
        engine: CopyEngine,
        *,
        offload_ratio: float,
        num_offloadable_layers: int,
        min_offload_bytes: int,
        excluded_ptrs: set[int],
    ) -> None:
        self.engine = engine
        self.offload_ratio = offload_ratio
        self._num_offloadable_layers = num_offloadable_layers
        self._min_offload_bytes = min_offload_bytes
        self._excluded_ptrs = excluded_ptrs
        self._offloaded: dict[StorageWeakRef, _OffloadRecord] = {}
        self._resident: dict[StorageWeakRef, _ResidentRecord] = {}
        self._layer_records: dict[int, list[_OffloadRecord]] = {}
        self._backward_layers: set[int] = set()
        self.saved_bytes = 0
        self.offloadable_bytes = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self.num_offloaded = 0
        self.num_prefetched = 0
        self.num_refused = 0
        self.bytes_refused = 0
        self.first_refusal: str | None = None

    def stats(self) -> dict[str, float | int]:
        """The counters as a plain dict."""
        return {
            "offload_ratio": self.offload_ratio,
            "saved_bytes": self.saved_bytes,
            "offloadable_bytes": self.offloadable_bytes,
            "bytes_to_host": self.bytes_to_host,
            "bytes_to_device": self.bytes_to_device,
            "resident_bytes": self.resident_bytes,
            "peak_resident_bytes": self.peak_resident_bytes,
            "num_offloaded": self.num_offloaded,
            "num_prefetched": self.num_prefetched,
            "num_refused": self.num_refused,
            "bytes_refused": self.bytes_refused,
        }

    def _add_resident(self, nbytes: int) -> None:
        self.resident_bytes += nbytes

    def _start_backward_of(self, layer: int) -> None:
        if layer in self._backward_layers:
            return
        self._backward_layers.add(layer)
        for index in (layer, layer - 1):
            for record in self._layer_records.pop(index, ()):
                if record.handle is not None:
                    self.engine.prefetch(record.handle)
                    self.num_prefetched += 1

    def pack(self, layer: int, tensor: torch.Tensor) -> Any:
        """Pack hook of layer `layer` (bound by the manager's forward pre-hook)."""
        if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, nn.Parameter):
            return tensor
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._excluded_ptrs:
            return tensor
        key = StorageWeakRef(storage)
        record = self._offloaded.get(key)
        if record is not None and record.dtype == tensor.dtype:
            if tensor._version != record.version:
                # The storage changed since its copy was taken: the copy is stale.
                raise RuntimeError(
                    "a storage offloaded for backward was modified in place before it was "
                    f"saved again (version {record.version}, now {tensor._version}) in layer "
                    f"{layer}"
                )
            return _Offloaded(record, layer, self._geometry(tensor, record), tensor)
        resident = self._resident.get(key)
        if resident is None and record is None:
            record = self._try_offload(layer, tensor, key, storage.nbytes())
            if record is not None:
                return _Offloaded(record, layer, self._geometry(tensor, record), tensor)
        if resident is None:
            resident = _ResidentRecord(self, key, storage.nbytes())
            self._resident[key] = resident
            if record is None:  # not a storage already counted as offloaded
                self.saved_bytes += resident.nbytes
            self._add_resident(resident.nbytes)
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        return _Resident(tensor, layer, resident)

    @staticmethod
    def _geometry(tensor: torch.Tensor, record: _OffloadRecord) -> tuple | None:
        geometry = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        return None if geometry == record.full_geometry else geometry

    def _refuse(self, layer: int, nbytes: int, exc: HostPoolExhaustedError) -> None:
        """Count a storage kept on the device for lack of host room."""
        if self.num_refused == 0:
            self.first_refusal = f"layer {layer}: {exc}"
        self.num_refused += 1
        self.bytes_refused += nbytes

    def _try_offload(
        self, layer: int, tensor: torch.Tensor, key: StorageWeakRef, nbytes: int
    ) -> _OffloadRecord | None:
        if (
            layer >= self._num_offloadable_layers
            or nbytes < self._min_offload_bytes
            or type(tensor) is not torch.Tensor
            or tensor.is_conj()
            or tensor.is_neg()
            or tensor.is_quantized
        ):
            return None
        base = _covering_tensor(tensor, nbytes)
        if base is None:
            return None
        self.offloadable_bytes += nbytes
        rows = offloaded_rows(self.offload_ratio, base.shape[0])
        if rows == 0:
            return None
        with torch.no_grad():
            base = base.detach()
            try:
                handle = self.engine.offload(base[:rows])
            except HostPoolExhaustedError as exc:
                self._refuse(layer, rows * (nbytes // base.shape[0]), exc)
                return None
            keep = base[rows:].clone() if rows < base.shape[0] else None
        record = _OffloadRecord(self, key, base, handle, keep)
        self._offloaded[key] = record
        self._layer_records.setdefault(layer, []).append(record)
        self.saved_bytes += nbytes
        self.bytes_to_host += rows * (nbytes // base.shape[0])
        self.num_offloaded += 1
        self._add_resident(record.device_bytes)
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        return record


class OffloadManager:
    """Offloads a share of each transformer layer's saved activations, per micro-batch.

    Args:
        engine: Copy engine (`HostCopyEngine` on CPU, `CudaCopyEngine` on GPU).
        num_layers: Transformer layers on this rank (pipeline stage); layers
            `0 .. num_layers - 3` offload, the last two stay resident.
        min_offload_bytes: Storages smaller than this stay resident.

    Raises:
        ValueError: If `num_layers < 1` or `min_offload_bytes < 0`.
    """

    def __init__(
        self,
        engine: CopyEngine,
        *,
        num_layers: int,
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    ) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be >= 0, got {min_offload_bytes}")
        self.engine = engine
        self.num_layers = num_layers
        self.min_offload_bytes = min_offload_bytes
        self._layers: list[nn.Module] = []
        self._handles: list[RemovableHandle] = []
        self._open: list[tuple[int, torch.autograd.graph.saved_tensors_hooks]] = []
        self._active: MicroBatchOffload | None = None
        self._last: MicroBatchOffload | None = None
        self.num_refusing_batches = 0  # micro-batches that kept a storage for lack of room

    @property
    def num_offloadable_layers(self) -> int:
        """Layers whose activations may be offloaded: all but the last two."""
        return max(0, self.num_layers - NUM_RESIDENT_LAYERS)

    def install(self, layers: Sequence[nn.Module]) -> None:
        """Hook the forward pass of each transformer layer, in execution order.

        Raises:
            ValueError: If `len(layers) != num_layers`.
            RuntimeError: If already installed.
        """
        if self._handles:
            raise RuntimeError("OffloadManager is already installed; call uninstall() first")
        layers = list(layers)
        if len(layers) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layers, got {len(layers)}")
        for index, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(partial(self._enter, index)))
            self._handles.append(
                layer.register_forward_hook(partial(self._exit, index), always_call=True)
            )
        self._layers = layers

    def uninstall(self) -> None:
        """Remove the layer hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._layers = []

    def _enter(self, index: int, module: nn.Module, args: Any) -> None:
        if self._active is None:
            return
        hooks = torch.autograd.graph.saved_tensors_hooks(partial(self._active.pack, index), _unpack)
        hooks.__enter__()
        self._open.append((index, hooks))

    def _exit(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._open and self._open[-1][0] == index:
            self._open.pop()[1].__exit__(None, None, None)

    def _excluded_ptrs(self) -> set[int]:
        tensors = itertools.chain.from_iterable(
            itertools.chain(layer.parameters(), layer.buffers()) for layer in self._layers
        )
        return {t.untyped_storage().data_ptr() for t in tensors}

    @contextmanager
    def micro_batch(self, offload_ratio: float) -> Iterator[MicroBatchOffload]:
        """Offload `offload_ratio` of the early layers' saved activations inside this context.

        The micro-batch's forward pass runs inside; its backward pass inside or after.
        Ratio 0 only accounts. Yields the micro-batch's `MicroBatchOffload` (counters).

        Raises:
            ValueError: If `offload_ratio` is not a number in [0, 1] (NaN included).
            RuntimeError: If a micro-batch context is already open.
        """
        try:
            ratio = float(offload_ratio)
        except (TypeError, ValueError):
            raise ValueError(
                f"offload_ratio must be a number in [0, 1], got {offload_ratio!r}"
            ) from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"offload_ratio must lie in [0, 1], got {offload_ratio!r}")
        if self._active is not None:
            raise RuntimeError("a micro_batch context is already open")
        batch = MicroBatchOffload(
            self.engine,
            offload_ratio=ratio,
            num_offloadable_layers=self.num_offloadable_layers,
            min_offload_bytes=self.min_offload_bytes,
            excluded_ptrs=self._excluded_ptrs(),
        )
        self._active = self._last = batch
        try:
            yield batch
        finally:
            self._active = None
            if batch.num_refused:
                self._report_refusal(batch)
            while self._open:  # only if a layer's forward hook did not run
                self._open.pop()[1].__exit__(None, None, None)

    def _report_refusal(self, batch: MicroBatchOffload) -> None:
        self.num_refusing_batches += 1
        if self.num_refusing_batches % 100 != 1:
            return
        logger.warning(
            "%d saved activations (%d bytes) of a micro-batch stayed on the device because "
            "the host pool was full (%s); %d micro-batches so far. Device memory exceeds the "
            "plan's resident estimate; raise --hdp-host-memory-gb.",
            batch.num_refused,
            batch.bytes_refused,
            batch.first_refusal,
            self.num_refusing_batches,
        )

    def stats(self) -> dict[str, float | int]:
        """Counters of the latest micro-batch (zeros before the first)."""
        if self._last is None:
            return MicroBatchOffload(
                self.engine,
                offload_ratio=0.0,
                num_offloadable_layers=0,
                min_offload_bytes=0,
                excluded_ptrs=set(),
            ).stats()
        return self._last.stats()

    @property
    def resident_bytes(self) -> int:
        """Device bytes held now by the latest micro-batch's saved activations."""
        return self._last.resident_bytes if self._last is not None else 0

    @property
    def peak_resident_bytes(self) -> int:
        """Peak of `resident_bytes` during the latest micro-batch's forward pass."""
        return self._last.peak_resident_bytes if self._last is not None else 0
