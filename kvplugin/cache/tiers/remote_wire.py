"""What one remote-tier value holds, and the checks a value passes before it is used.

A value is ``MAGIC | blake2b-256 of the rest | safetensors bytes``. The safetensors part is
the SSD tier's layout (:mod:`kvplugin.cache.tiers.serialize`: arrays by name, JSON layer
descriptors, the entry's tokens as a tensor): no code runs on load, never pickle. The digest
covers the header and the data, so a flipped, truncated or foreign value is a miss, never
served. The namespace and the tokens are checked against the key the value was read under.

Why the digest is filled in late (:func:`seal`): serializing reads MLX arrays and must run on
the thread that owns them (the request's), while hashing a few hundred MiB is plain CPU work
that the writer thread does, off the request's path.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence

import mlx.core as mx

from kvplugin.cache.layers import can_copy_prefix
from kvplugin.cache.tiers.serialize import Corrupt, deserialize_cache, serialize_cache

__all__ = ["MAGIC", "Corrupt", "decode", "encode", "seal"]

MAGIC = b"KVP1WIRE"
_DIGEST = 32
_HEAD = len(MAGIC) + _DIGEST
TOKENS = "__tokens__"


def encode(namespace: str, tokens: Sequence[int], cache: list) -> tuple[io.BytesIO, bool]:
    """``cache`` holding ``tokens`` as an unsealed value, and whether it may be cut to a
    shorter prefix (raises ``serialize.Unsupported``)."""
    arrays, layers = serialize_cache(cache)
    arrays[TOKENS] = mx.array(list(tokens), dtype=mx.int64)
    mx.eval(list(arrays.values()))
    trimmable = can_copy_prefix(cache, len(tokens))
    meta = {
        "namespace": namespace,
        "n_tokens": str(len(tokens)),
        "trimmable": "1" if trimmable else "0",
        "layers": json.dumps(layers, separators=(",", ":")),
    }
    buf = io.BytesIO()
    buf.write(MAGIC + bytes(_DIGEST))
    mx.save_safetensors(buf, arrays, meta)
    return buf, trimmable


def seal(buf: io.BytesIO) -> memoryview:
    """Write the digest into ``buf``; the value's bytes, without a copy."""
    view = buf.getbuffer()
    view[len(MAGIC):_HEAD] = hashlib.blake2b(view[_HEAD:], digest_size=_DIGEST).digest()
    return view


def decode(raw: bytes, namespace: str, max_bytes: int) -> tuple[tuple, list, bool]:
    """``(tokens, cache, trimmable)`` from a value read under ``namespace``; raises
    :class:`Corrupt` on anything but a whole, intact value of this namespace."""
    if len(raw) > max_bytes:
        raise Corrupt(f"value of {len(raw)} bytes is over the {max_bytes}-byte bound")
    view = memoryview(raw)
    if len(raw) <= _HEAD or bytes(view[:len(MAGIC)]) != MAGIC:
        raise Corrupt("not a kvplugin value")
    if hashlib.blake2b(view[_HEAD:], digest_size=_DIGEST).digest() != bytes(view[len(MAGIC):_HEAD]):
        raise Corrupt("value does not match its digest")
    try:
        arrays, meta = mx.load(io.BytesIO(view[_HEAD:]), format="safetensors",
                               return_metadata=True)
        if meta.get("namespace") != namespace:
            raise Corrupt("value of another namespace")
        tokens = arrays.pop(TOKENS)
        if tokens.ndim != 1 or tokens.size != int(meta["n_tokens"]):
            raise Corrupt("token count does not match")
        cache = deserialize_cache(arrays, json.loads(meta["layers"]))
        mx.eval(list(arrays.values()))
        return tuple(tokens.tolist()), cache, meta.get("trimmable") == "1"
    except Corrupt:
        raise
    except Exception as e:  # a malformed header, a missing field: never a crash
        raise Corrupt(f"unreadable value: {type(e).__name__}: {e}") from None
