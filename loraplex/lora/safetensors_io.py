"""Strict reading of an untrusted ``.safetensors`` buffer.

The header is parsed here with ``json`` + ``struct`` and checked (size cap, dtypes, shapes,
offsets inside the data area, no gaps or overlaps) before any tensor is built, so a hostile file
can neither make us allocate a huge header nor read outside its buffer.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

from loraplex.lora.errors import InvalidAdapterError

MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype tag -> (torch dtype, bytes per element). Only float formats: LoRA weights.
FLOAT_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F64": (torch.float64, 8),
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as described by the header; ``begin``/``end`` are offsets into the data area."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class SafetensorsFile:
    """A validated safetensors buffer: header entries plus the raw bytes they point into."""

    entries: dict[str, TensorEntry]
    data: memoryview  # the data area (after the 8-byte length and the header)

    def raw_bytes(self, name: str) -> memoryview:
        e = self.entries[name]
        return self.data[e.begin : e.end]

    def tensor(self, name: str) -> torch.Tensor:
        """A CPU tensor owning a copy of the bytes (the file buffer may be dropped afterwards)."""
        e = self.entries[name]
        dtype, _ = FLOAT_DTYPES[e.dtype]
        raw = bytearray(self.raw_bytes(name))
        if not raw:
            return torch.empty(e.shape, dtype=dtype)
        # safetensors stores little-endian; every platform torch supports here is little-endian
        return torch.frombuffer(raw, dtype=dtype).reshape(e.shape)


def _bad(msg: str) -> InvalidAdapterError:
    return InvalidAdapterError(f"adapter_model.safetensors: {msg}")


def parse_safetensors(buf: bytes | bytearray | memoryview, max_header_bytes: int = MAX_HEADER_BYTES) -> SafetensorsFile:
    """Validate the header of ``buf`` and return its entries. Raises ``InvalidAdapterError``."""
    view = memoryview(buf)
    if len(view) < 8:
        raise _bad("file is shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > max_header_bytes:
        raise _bad(f"header of {header_len} bytes exceeds the cap of {max_header_bytes} bytes")
    if 8 + header_len > len(view):
        raise _bad(f"header length {header_len} points past the end of the file ({len(view)} bytes)")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # as in adapter_config.parse_config
        raise _bad(f"header is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise _bad("header is not a JSON object")
    data = view[8 + header_len :]

    meta = header.pop("__metadata__", None)
    if meta is not None and (
        not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        raise _bad("__metadata__ must map strings to strings")

    entries: dict[str, TensorEntry] = {}
    for name, desc in header.items():
        entries[name] = _parse_entry(name, desc, len(data))

    # Tensors must tile the data area exactly: no gaps, no overlaps, nothing after the last one.
    expected = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != expected:
            raise _bad(f"tensor {e.name!r} starts at offset {e.begin}, expected {expected} (gap or overlap)")
        expected = e.end
    if expected != len(data):
        raise _bad(f"tensors cover {expected} bytes but the data area holds {len(data)} bytes")
    return SafetensorsFile(entries=entries, data=data)


def _parse_entry(name: str, desc: object, data_len: int) -> TensorEntry:
    if not isinstance(desc, dict):
        raise _bad(f"entry {name!r} is not an object")
    dtype = desc.get("dtype")
    shape = desc.get("shape")
    offsets = desc.get("data_offsets")
    if dtype not in FLOAT_DTYPES:
        raise _bad(f"tensor {name!r} has dtype {dtype!r}; LoRA weights must be one of {sorted(FLOAT_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _bad(f"tensor {name!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise _bad(f"tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise _bad(f"tensor {name!r} has data_offsets {offsets} out of order")
    if end > data_len:
        raise _bad(f"tensor {name!r} data_offsets {offsets} point outside the file (data area {data_len} bytes)")
    nbytes = math.prod(shape) * FLOAT_DTYPES[dtype][1]
    if end - begin != nbytes:
        raise _bad(f"tensor {name!r} spans {end - begin} bytes but dtype {dtype} and shape {shape} need {nbytes}")
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)
