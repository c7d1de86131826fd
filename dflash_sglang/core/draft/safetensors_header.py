"""Safetensors headers read without touching tensor data (fast enough to run before a server loads anything).

File layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON `{name: {dtype, shape, data_offsets},
"__metadata__": {...}}`, then the tensor bytes; `data_offsets` [begin, end) count from the first byte after the
header. Everything that would make the safetensors library refuse the file later is reported here as one
`CheckpointError` line naming the file and tensor: short or truncated files, unparseable headers, bad entries.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import CheckpointError

LENGTH_BYTES = 8
# The safetensors library refuses headers above 100 MB; refusing them here too avoids reading a garbage length.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
# Bytes per element of each safetensors dtype code (sub-byte F4 / F6 codes are absent: no size check for them).
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


@dataclass(frozen=True)
class TensorHeader:
    """One tensor's header entry: its file, name as stored, safetensors dtype code, shape and data byte range."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]


def read_header(path: Path) -> list[TensorHeader]:
    """The tensor entries of one safetensors file, in header order; reads only the header bytes."""
    size = path.stat().st_size
    unreadable = f"{path}: not a readable safetensors file"
    with path.open("rb") as fh:
        prefix = fh.read(LENGTH_BYTES)
        if len(prefix) < LENGTH_BYTES:
            raise CheckpointError(f"{unreadable} ({size} bytes, shorter than the {LENGTH_BYTES}-byte header length)")
        n = int.from_bytes(prefix, "little")
        if n > size - LENGTH_BYTES or n > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{unreadable} (header length {n} exceeds the {size - LENGTH_BYTES} bytes that follow: truncated?)"
            )
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{unreadable} (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{unreadable} (header is {type(header).__name__}, not a JSON object)")
    data_bytes = size - LENGTH_BYTES - n
    return [_entry(path, name, e, data_bytes) for name, e in header.items() if name != METADATA_KEY]


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry(path: Path, name: str, e: Any, data_bytes: int) -> TensorHeader:
    ok = (
        isinstance(e, dict) and isinstance(e.get("dtype"), str)
        and isinstance(e.get("shape"), list) and all(_is_uint(d) for d in e["shape"])
        and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
        and all(_is_uint(o) for o in e["data_offsets"]) and e["data_offsets"][0] <= e["data_offsets"][1]
    )
    if not ok:
        raise CheckpointError(f"{path}: tensor '{name}' has a malformed header entry {json.dumps(e)[:200]}")
    begin, end = e["data_offsets"]
    if end > data_bytes:
        raise CheckpointError(
            f"{path}: tensor '{name}' data ends at byte {end} but only {data_bytes} data bytes follow the header "
            f"(truncated file)"
        )
    width = DTYPE_BYTES.get(e["dtype"])
    need = math.prod(e["shape"]) * width if width is not None else end - begin
    if end - begin != need:
        raise CheckpointError(
            f"{path}: tensor '{name}' has {end - begin} data bytes, but {e['dtype']} {e['shape']} needs {need}"
        )
    return TensorHeader(path, name, e["dtype"], tuple(e["shape"]), (begin, end))
