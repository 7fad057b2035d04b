"""msgpack codec for the frontend <-> engine wire: arrays by (dtype, shape, data) and the
columnar output batch.

Why a codec module apart from wire.py: the structs are the ABI (torch/zmq/numpy-free); this module
is *how* they become frames.

- Arrays (numpy ndarrays, torch tensors) encode as `(dtype, shape, data)`. Below
  `size_threshold` bytes, `data` is the bytes inline; above it, `data` is an int index into extra
  frames that follow the msgpack frame, handed to ZeroMQ without a copy. The sender must keep
  those buffers (and the reused encode buffer) alive until ZeroMQ is done: the engine's output
  thread (core/engine_core_proc/io_threads.py) tracks them with zmq MessageTrackers.
- `encode_into` writes into a caller-owned bytearray, so the engine's output thread recycles
  a few buffers instead of allocating one per step.
- `OutputCodec` converts a step's outputs between their one in-process shape (StepOutput:
  decode tokens as columns, the rest whole) and their one wire shape (the columnar OutputBatch)
  at the socket edge: `pack` in the engine process, `unpack` in the frontend's client. Requests
  are named by the small wire handle their ADD carried.
- No pickle: an object msgspec cannot encode is an error, not a fallback.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from shoal.engine.core.sched_output import StepOutput
from shoal.engine.wire import EngineCoreOutput, OutputBatch

# Arrays smaller than this travel inline in the msgpack frame; a separate frame costs more than
# copying a few hundred bytes (vLLM's VLLM_MSGPACK_ZERO_COPY_THRESHOLD default).
DEFAULT_ZERO_COPY_THRESHOLD = 256

_LITTLE = sys.byteorder == "little"
_WIDTH_CODE = {2: "H", 4: "I"}
assert array("I").itemsize == 4 and array("H").itemsize == 2


def _array_types() -> tuple[type | None, type | None]:
    """numpy.ndarray and torch.Tensor if those modules are loaded; the codec never imports torch."""
    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    return (np.ndarray if np else None), (torch.Tensor if torch else None)


class MsgpackEncoder:
    """One per thread (it holds the aux-buffer list of the message being encoded)."""

    def __init__(self, size_threshold: int = DEFAULT_ZERO_COPY_THRESHOLD) -> None:
        self.size_threshold = size_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: list[Any] | None = None

    def encode(self, obj: Any) -> list[bytes | memoryview]:
        """Frames: the msgpack bytes, then one buffer per out-of-band array."""
        self._aux = aux = []
        try:
            return [self._encoder.encode(obj), *aux]
        finally:
            self._aux = None

    def encode_into(self, obj: Any, buf: bytearray) -> list[bytearray | memoryview]:
        """Like encode, but the msgpack frame is written into `buf` (resized as needed)."""
        self._aux = aux = []
        try:
            self._encoder.encode_into(obj, buf)
            return [buf, *aux]
        finally:
            self._aux = None

    def _enc_hook(self, obj: Any) -> Any:
        ndarray, tensor = _array_types()
        if ndarray is not None and isinstance(obj, ndarray):
            if obj.dtype.hasobject:
                raise TypeError("object arrays cannot cross the wire (no pickle)")
            return self._encode_buffer(obj.dtype.str, obj.shape, obj)
        if tensor is not None and isinstance(obj, tensor):
            import torch

            t = obj.detach().to("cpu").contiguous()
            raw = t.view(torch.uint8).numpy() if t.numel() else b""
            return self._encode_buffer(str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
        raise TypeError(f"{type(obj).__name__} cannot cross the wire (no pickle); "
                        "use a wire struct")

    def _encode_buffer(self, dtype: str, shape: tuple, arr: Any) -> tuple:
        data = memoryview(arr).cast("B") if len(arr) else memoryview(b"")
        if data.nbytes < self.size_threshold or self._aux is None:
            return dtype, shape, data
        self._aux.append(data)
        return dtype, shape, len(self._aux) - 1


class MsgpackDecoder:
    """Decodes frames from MsgpackEncoder into `type`; arrays come back as zero-copy views of
    their frames (numpy) or tensors over them (torch)."""

    def __init__(self, type_: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_, dec_hook=self._dec_hook)
        self._aux: Sequence[Any] = ()

    def decode(self, frames: Sequence[Any] | bytes | memoryview) -> Any:
        if isinstance(frames, (bytes, bytearray, memoryview)):
            return self._decoder.decode(frames)
        self._aux = [getattr(f, "buffer", f) for f in frames[1:]]
        try:
            return self._decoder.decode(getattr(frames[0], "buffer", frames[0]))
        finally:
            self._aux = ()

    def _dec_hook(self, type_: type, obj: Any) -> Any:
        ndarray, tensor = _array_types()
        if type_ is ndarray or type_ is tensor:
            dtype, shape, data = obj
            buf = self._aux[data] if isinstance(data, int) else data
            if type_ is ndarray:
                import numpy as np

                return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
            import warnings

            import torch

            with warnings.catch_warnings():  # read-only frame buffers: fine for consumers
                warnings.simplefilter("ignore")
                flat = (torch.frombuffer(buf, dtype=getattr(torch, dtype)) if len(buf)
                        else torch.empty(0, dtype=getattr(torch, dtype)))
            return flat.reshape(shape)
        raise TypeError(f"cannot decode {type_!r} from the wire")


# ----- columnar outputs ---------------------------------------------------------------------


def _pack(values: Sequence[int]) -> tuple[int, bytes]:
    """(width, little-endian bytes): 2 bytes per entry when every value fits, else 4."""
    n = len(values)
    try:
        return 2, struct.pack(f"<{n}H", *values)
    except struct.error:
        return 4, struct.pack(f"<{n}I", *values)


def _unpack(data: bytes, width: int) -> array:
    values = array(_WIDTH_CODE[width])
    values.frombytes(data)
    if not _LITTLE:
        values.byteswap()
    return values


class OutputCodec:
    """StepOutput <-> OutputBatch. The engine side names requests by handle; the frontend side
    maps handles back to request ids."""

    @staticmethod
    def pack(step: StepOutput, handle_of: Callable[[str], int | None]) -> OutputBatch:
        """The engine's side. `handle_of(request_id)` -> the handle the request's ADD carried,
        or None: then the output travels in extras with its full id."""
        handles = list(map(handle_of, step.decode_req_ids))
        tokens = step.decode_token_ids
        extras: list[EngineCoreOutput] = []
        extra_handles: list[int] = []
        if None in handles:  # requests added without a handle (rare): whole, by id
            ids = step.decode_req_ids
            keep = [i for i, h in enumerate(handles) if h is not None]
            extras = [EngineCoreOutput(ids[i], [tokens[i]])
                      for i, h in enumerate(handles) if h is None]
            extra_handles = [-1] * len(extras)
            handles, tokens = [handles[i] for i in keep], [tokens[i] for i in keep]
        for o in step.outputs:
            h = handle_of(o.request_id)
            if h is None:
                extras.append(o)
                extra_handles.append(-1)
            else:
                extras.append(msgspec.structs.replace(o, request_id=""))
                extra_handles.append(h)
        hw, handle_bytes = _pack(handles)
        tw, token_bytes = _pack(tokens)
        return OutputBatch(handle_width=hw, token_width=tw, handles=handle_bytes,
                           token_ids=token_bytes, extras=extras, extra_handles=extra_handles,
                           scheduler_stats=step.scheduler_stats, timestamp=step.timestamp,
                           utility_output=step.utility_output,
                           finished_requests=step.finished_requests or None,
                           rejected=step.rejected)

    @staticmethod
    def unpack(batch: OutputBatch, id_of: dict[int, str]) -> StepOutput:
        """The frontend's side. A column's request id is None where the frontend already
        dropped the handle (aborted): that token is to be ignored; handles are never reused
        while the engine may still emit for them. A whole output of an unknown handle is
        dropped, never misattributed."""
        get = id_of.get
        outputs: list[EngineCoreOutput] = []
        for h, o in zip(batch.extra_handles, batch.extras, strict=True):
            if h >= 0:
                rid = get(h)
                if rid is None:
                    continue
                o.request_id = rid
            outputs.append(o)
        return StepOutput(
            decode_req_ids=list(map(get, _unpack(batch.handles, batch.handle_width))),
            decode_token_ids=_unpack(batch.token_ids, batch.token_width),
            outputs=outputs, scheduler_stats=batch.scheduler_stats, rejected=batch.rejected,
            utility_output=batch.utility_output, timestamp=batch.timestamp)
