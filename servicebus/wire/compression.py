"""Frame compression, sans I/O: which codecs this process has, a thread's compressor, and
the bounded decompression a receiver runs on a batch frame's body.

Only a batch frame's body is ever compressed (its header says so with ``z``), and only to
a peer whose PONG lists the codec. Decompression is the one place a few KB off the wire
can ask for gigabytes (DESIGN rule 12): ``_decompress`` never produces more than the limit
its caller gives (``protocol.frame_body_limit``), whatever the frame declares.
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import ProtocolError

__all__ = ["COMPRESS_MIN", "codecs"]

COMPRESS_MIN = 1024  # bytes of packed payloads below which a frame is sent as it is


def codecs() -> tuple[str, ...]:
    """Codecs this process can decode (and encode): zstd with the ``compression`` extra."""
    return ("zstd",) if _zstd() is not None else ()


_zstd_mod: Any = False


def _zstd() -> Any:
    """The zstandard module, or None without the ``compression`` extra (imported once)."""
    global _zstd_mod
    if _zstd_mod is False:
        try:
            import zstandard as module
        except ImportError:
            module = None  # type: ignore[assignment]
        _zstd_mod = module
    return _zstd_mod


_local = threading.local()


def _compressor() -> Any:
    """This thread's zstd compressor (one compressor must not be used by two at once)."""
    comp = getattr(_local, "zstd", None)
    if comp is None:
        comp = _local.zstd = _zstd().ZstdCompressor(level=1)  # fast; frames are small
    return comp



_READ = 1 << 18  # bytes decompressed per step of a stream: the cap is never overshot by more


def _decompress(codec: Any, data: bytes, limit: int) -> bytes:
    """A compressed body, never more than ``limit`` bytes (rule 12: a frame of a few KB
    may hold gigabytes). A frame that declares more is refused before anything is
    allocated; one that declares its size is decompressed into a buffer of that size,
    which zstd refuses to write past; one that does not (a stream) is decompressed step by
    step and refused the moment it passes ``limit``. The window zstd allocates for it is
    bounded by ``limit`` too: a frame may ask for far more than it holds."""
    zstd = _zstd()
    if codec != "zstd" or zstd is None:
        raise ProtocolError("bad_compression", f"codec {str(codec)[:16]!r} is not one this bus decodes")
    try:
        declared = zstd.frame_content_size(data)
        if declared > limit:
            raise ProtocolError("bad_compression", f"declares {declared} bytes, more than {limit}")
        # No window larger than the frame may be: a power of two >= limit (zstd's unit).
        dctx = zstd.ZstdDecompressor(max_window_size=1 << max(10, (limit - 1).bit_length()))
        if declared >= 0:  # what encode_batch makes; a frame that holds more than it says fails
            return bytes(dctx.decompress(data, max_output_size=declared))
        reader = dctx.stream_reader(data)
        parts = []
        size = 0
        while True:
            part = reader.read(_READ)
            if not part:
                break
            size += len(part)
            if size > limit:
                raise ProtocolError("bad_compression", f"decompresses to more than {limit} bytes")
            parts.append(part)
        # A stream cut short reads as its first part: the msgpack body then ends in the
        # middle (or exactly at its end, when nothing is missing), and unpacking it tells.
        return b"".join(parts)
    except zstd.ZstdError as exc:
        raise ProtocolError("bad_compression", str(exc)[:200]) from exc
