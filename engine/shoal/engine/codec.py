"""msgpack codec for the frontend <-> engine wire: arrays by (dtype, shape, data) and the
columnar output batch.

Why a codec module apart from wire.py: the structs are the ABI (torch/zmq/numpy-free); this module
is *how* they become frames.

- Arrays (numpy ndarrays, torch tensors) encode as `(dtype, shape, data)`. Below
  `size_threshold` bytes, `data` is the bytes inline; above it, `data` is an int index into extra
  frames that follow the msgpack frame, handed to ZeroMQ without a copy. The sender must keep
  those buffers (and the reused encode buffer) alive until ZeroMQ is done: engine_core_proc.py
  tracks them with zmq MessageTrackers.
- `encode_into` writes into a caller-owned bytearray, so the engine's output thread recycles
  a few buffers instead of allocating one per step.
- `OutputCodec` converts EngineCoreOutputs (per-request objects, what EngineCore.step() returns
  and what the OutputProcessor consumes) to and from the columnar OutputBatch at the socket
  edge. Requests are named by the small wire handle their ADD carried.
- No pickle: an object msgspec cannot encode is an error, not a fallback.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from shoal.engine.wire import EngineCoreOutput, EngineCoreOutputs, OutputBatch

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
        raise TypeError(f"{type(obj).__name__} cannot cross the wire (no pickle); use a wire struct")

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

_OUTPUT_FIELDS = msgspec.structs.fields(EngineCoreOutput)
# Fields beyond the ones checked inline below (anything appended later): a plain decode output
# has all of them at their defaults.
_KNOWN = {"request_id", "new_token_ids", "finish_reason", "stop_reason", "num_cached_tokens"}
_OTHER_DEFAULTS = [(f.name, f.default) for f in _OUTPUT_FIELDS if f.name not in _KNOWN]


def _is_plain(o: EngineCoreOutput) -> bool:
    if (len(o.new_token_ids) != 1 or o.finish_reason is not None or o.stop_reason is not None
            or o.num_cached_tokens):
        return False
    for name, default in _OTHER_DEFAULTS:
        if getattr(o, name) != default:
            return False
    return True


def _pack(values: list[int]) -> tuple[int, bytes]:
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
    """EngineCoreOutputs <-> OutputBatch. The engine side names requests by handle; the frontend
    side maps handles back to request ids."""

    @staticmethod
    def pack(decode_req_ids: list[str], decode_token_ids: list[int],
             outputs: list[EngineCoreOutput], handle_of: Callable[[str], int | None],
             **fields: Any) -> OutputBatch:
        """Decode-token columns (request ids, token ids) and whole outputs -> OutputBatch, the
        way the engine sends a step (`fields`: the OutputBatch fields beyond the outputs).
        `handle_of(request_id)` -> the handle the request's ADD carried, or None: then the
        output travels in extras with its full id."""
        handles = list(map(handle_of, decode_req_ids))
        tokens = decode_token_ids
        extras: list[EngineCoreOutput] = []
        extra_handles: list[int] = []
        if None in handles:  # requests added without a handle (rare): whole, by id
            keep = [i for i, h in enumerate(handles) if h is not None]
            extras = [EngineCoreOutput(decode_req_ids[i], [tokens[i]])
                      for i, h in enumerate(handles) if h is None]
            extra_handles = [-1] * len(extras)
            handles, tokens = [handles[i] for i in keep], [tokens[i] for i in keep]
        for o in outputs:
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
                           **fields)

    @staticmethod
    def to_batch(outs: EngineCoreOutputs, handle_of: Callable[[str], int | None]) -> OutputBatch:
        """The per-request form -> OutputBatch: plain outputs into the columns, the rest whole."""
        ids: list[str] = []
        toks: list[int] = []
        others: list[EngineCoreOutput] = []
        for o in outs.outputs:
            if _is_plain(o):
                ids.append(o.request_id)
                toks.append(o.new_token_ids[0])
            else:
                others.append(o)
        return OutputCodec.pack(
            ids, toks, others, handle_of, engine_index=outs.engine_index,
            scheduler_stats=outs.scheduler_stats, timestamp=outs.timestamp,
            utility_output=outs.utility_output, finished_requests=outs.finished_requests,
            rejected=outs.rejected)

    @staticmethod
    def columns(batch: OutputBatch, id_of: dict[int, str]
                ) -> tuple[list[str | None], array, list[EngineCoreOutput]]:
        """The decode-token columns as (request ids, token ids) and the other outputs with their
        ids restored. A request id is None where the frontend already dropped the handle
        (aborted): its output is to be ignored, handles are never reused while the engine may
        still emit for them. The frontend consumes this form without per-token objects."""
        get = id_of.get
        rids = list(map(get, _unpack(batch.handles, batch.handle_width)))
        toks = _unpack(batch.token_ids, batch.token_width)
        extras: list[EngineCoreOutput] = []
        for h, o in zip(batch.extra_handles, batch.extras, strict=True):
            if h >= 0:
                rid = get(h)
                if rid is None:
                    continue
                o.request_id = rid
            extras.append(o)
        return rids, toks, extras

    @staticmethod
    def from_batch(batch: OutputBatch, id_of: dict[int, str]) -> EngineCoreOutputs:
        """Back to per-request EngineCoreOutput objects (the EngineCoreClient contract)."""
        rids, toks, extras = OutputCodec.columns(batch, id_of)
        outputs = [EngineCoreOutput(r, [t]) for r, t in zip(rids, toks, strict=True)
                   if r is not None]
        outputs += extras
        return OutputCodec.shell(batch, outputs)

    @staticmethod
    def shell(batch: OutputBatch, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        return EngineCoreOutputs(
            engine_index=batch.engine_index,
            outputs=outputs,
            scheduler_stats=batch.scheduler_stats,
            timestamp=batch.timestamp,
            utility_output=batch.utility_output,
            finished_requests=batch.finished_requests,
            rejected=batch.rejected,
        )
