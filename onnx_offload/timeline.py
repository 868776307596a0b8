"""The residency timeline as a PNG: one row per weight (in pack order), one column per
segment acquire; grey is evicted, blue resident in the weights zone, orange streamed
through the transient zone. Written with zlib alone, so no plotting library is needed."""
from __future__ import annotations

import struct
import zlib
from typing import Sequence

import numpy as np

COLORS = np.array([[235, 235, 235], [31, 119, 180], [255, 127, 14]], dtype=np.uint8)


def write_png(path: str, rgb: np.ndarray) -> str:
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)
    return path


def residency_png(path: str, timeline: Sequence[bytes], width: int = 960, height: int = 480) -> str:
    if not timeline:
        raise ValueError("the timeline is empty: create the session with record_timeline=True and run it")
    grid = np.frombuffer(b"".join(timeline), dtype=np.uint8).reshape(len(timeline), -1).T  # weights x acquires
    sy = max(1, height // grid.shape[0])
    sx = max(1, width // grid.shape[1])
    img = COLORS[np.repeat(np.repeat(grid, sy, axis=0), sx, axis=1)]
    return write_png(path, img)
