"""(De)serialisation of a cache entry for a cold tier: arrays by name plus JSON descriptors.

Why apart from the tier: what a layer *is* on disk (its layout, its scalar attributes, which
slots hold tokens) is layer knowledge, the same for any tier that stores bytes (a file, a
remote key-value store); the tier only decides where the bytes go. Layouts and their fields
come from :mod:`kvplugin.cache.layers`.

Format: ``serialize_cache(cache) -> (arrays, layers)``; ``arrays`` maps names
``l<i>.<field>[.<j>]`` (``CacheList`` children ``l<i>.c<j>.``) to ``mx.array``; ``layers`` is
one JSON-able descriptor per layer: ``kind`` (mlx-lm base class used for the layout),
``cls`` (``module:qualname`` of the real class), ``attrs`` (scalars), ``arrays``. Only the
used positions are kept (a rotating cache that has wrapped is kept whole with its ``_idx``);
quantized layers stay quantized, kvplugin's own ``QuantizedRotatingKVCache`` (a rotating layer
stored quantized) included: its packed slots whole, its scalars as they are. On load the real
class is used if its module is already imported (nothing is imported from data) and it
subclasses the recorded kind.

What a class names in ``TRANSIENT_ATTRS`` is not written: a bounded layer's undo log
(``PreallocatedRotatingKVCache``) belongs to the request that wrote the tokens. An entry is
stored at its key, its log dropped (``prealloc.rewind_decode``: a wrapped one rewound to its
prompt boundary first), and a log never changes what a layer holds: a restored layer holds
exactly what its key says, can be trimmed as the stored one could, and logs anew.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _mlc

from kvplugin.cache.layers import KNOWN_FIELDS, extra_scalars, layout_of
from kvplugin.cache.codec.state import QuantizedArraysCache  # noqa: F401 (resolved by name)

__all__ = ["Corrupt", "Unsupported", "deserialize_cache", "serialize_cache"]

_SCALAR_TYPES = (int, float, bool, str, type(None))


class Unsupported(Exception):
    """The entry holds a layer this format cannot represent (the tier refuses it): ``kind``
    is the layer's class name, ``why`` the reason, so a tier can say both once and count them."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"{kind}: {why}")
        self.kind = kind
        self.why = why


class _NotPortable(Exception):
    """Raised below :func:`_ser_layer`, which names the layer class in :class:`Unsupported`."""


class Corrupt(Exception):
    """Stored data that does not describe a valid entry."""


def _cls_spec(obj) -> str:
    t = type(obj)
    return f"{t.__module__}:{t.__qualname__}"


def _resolve(spec: str, kind: str):
    base = getattr(_mlc, kind, None)
    if base is None:
        raise Corrupt(f"unknown layer kind {kind!r}")
    module, _, qual = spec.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qual.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    if obj is None:  # e.g. a class registered into mlx_lm.models.cache by name
        obj = getattr(_mlc, qual, None) if "." not in qual else None
    if isinstance(obj, type) and issubclass(obj, base):
        return obj
    return base


def _slice(x, n: int):
    return x if x.shape[-2] == n else x[..., :n, :]


def _put_arrays(arrays: dict, name: str, value, n: int | None):
    """Register array(s) ``value`` (cut to n positions if n is not None) -> descriptor."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        names = []
        for j, a in enumerate(value):
            if not isinstance(a, mx.array):
                raise _NotPortable(f"{name}[{j}] is not an array")
            arrays[f"{name}.{j}"] = a if n is None else _slice(a, n)
            names.append(f"{name}.{j}")
        return {"seq": "tuple" if isinstance(value, tuple) else "list", "names": names}
    if not isinstance(value, mx.array):
        raise _NotPortable(f"{name} is not an array")
    arrays[name] = value if n is None else _slice(value, n)
    return name


_QROT = "QuantizedRotatingKVCache"


def _ser_qrot(layer, prefix: str, arrays: dict) -> dict:
    attrs = {k: v for k, v in vars(layer).items() if k not in ("keys", "values")}
    if not all(isinstance(v, _SCALAR_TYPES) for v in attrs.values()):
        raise _NotPortable(f"non-scalar attributes {sorted(_non_scalars(attrs))}")
    return {"kind": _QROT, "cls": _cls_spec(layer), "attrs": attrs,
            "arrays": {f: _put_arrays(arrays, f"{prefix}{f}", getattr(layer, f), None)
                       for f in ("keys", "values")}}


def _de_qrot(desc: dict, arrays: dict):
    from kvplugin.cache.codec.rotating import QuantizedRotatingKVCache

    obj = QuantizedRotatingKVCache()
    for k, v in desc["attrs"].items():
        if (k not in vars(obj) and k not in obj.OPTIONAL) or not isinstance(v, _SCALAR_TYPES):
            raise Corrupt(f"{_QROT}: unexpected attribute {k!r}")
        setattr(obj, k, v)
    obj.keys = _get_arrays(arrays, desc["arrays"]["keys"])
    obj.values = _get_arrays(arrays, desc["arrays"]["values"])
    keys, values = obj.keys or (), obj.values or ()
    ints = (obj.offset, obj.max_size, obj.keep, obj._idx, obj.bits, obj.group_size)
    if (not 2 <= min(len(keys), len(values)) <= max(len(keys), len(values)) <= 4
            or not all(isinstance(x, int) and x >= 0 for x in ints)
            or keys[0].shape[-2] != values[0].shape[-2]):
        raise Corrupt(f"{_QROT}: inconsistent arrays or scalars")
    return obj  # the codec's own record is checked where it is read (a miss if unknown)


def _non_scalars(attrs: dict) -> list[str]:
    return [k for k, v in attrs.items() if not isinstance(v, _SCALAR_TYPES)]


def _ser_layer(layer, prefix: str, arrays: dict) -> dict:
    """One layer's descriptor; :class:`Unsupported` names the first layer (a ``CacheList``
    child rather than the list) that this format cannot hold, and why."""
    try:
        return _ser_one(layer, prefix, arrays)
    except (_NotPortable, AttributeError, TypeError) as e:
        raise Unsupported(type(layer).__name__, str(e)) from None


def _ser_one(layer, prefix: str, arrays: dict) -> dict:
    if type(layer).__name__ == _QROT and type(layer).__module__ == "kvplugin.cache.codec.rotating":
        return _ser_qrot(layer, prefix, arrays)
    kind = layout_of(layer)
    if kind is None:
        raise _NotPortable("not a subclass of an mlx-lm cache class this format knows")
    attrs = extra_scalars(layer, kind)
    if attrs is None:
        skip = (*KNOWN_FIELDS[kind], *getattr(type(layer), "TRANSIENT_ATTRS", ()))
        names = _non_scalars({k: v for k, v in vars(layer).items() if k not in skip})
        raise _NotPortable(f"non-scalar attributes {sorted(names)}")
    desc: dict = {"kind": kind, "cls": _cls_spec(layer), "attrs": attrs, "arrays": {}}
    if kind == "CacheList":
        desc["children"] = [_ser_layer(c, f"{prefix}c{j}.", arrays) for j, c in enumerate(layer.caches)]
        desc["tuple"] = isinstance(layer.caches, tuple)
        return desc
    if kind == "ArraysCache":
        cache = layer.cache
        desc["arrays"]["cache"] = [
            _put_arrays(arrays, f"{prefix}cache.{j}", a, None) for j, a in enumerate(cache)
        ]
        for f in ("left_padding", "lengths"):
            desc["arrays"][f] = _put_arrays(arrays, f"{prefix}{f}", getattr(layer, f, None), None)
        return desc
    for f in KNOWN_FIELDS[kind]:
        if f not in ("keys", "values"):
            v = getattr(layer, f)
            if not isinstance(v, _SCALAR_TYPES):
                raise _NotPortable(f"{f} is not a scalar")
            attrs[f] = v
    offset = layer.offset
    n: int | None = offset
    if kind == "ChunkedKVCache":
        n = offset - layer.start_position
    elif kind == "RotatingKVCache":
        if not (offset < layer.max_size and layer._idx == offset):
            n = None  # wrapped or concat layout: keep the whole buffer and _idx
    for f in ("keys", "values"):
        desc["arrays"][f] = _put_arrays(arrays, f"{prefix}{f}", getattr(layer, f), n)
    return desc


def serialize_cache(cache: list) -> tuple[dict, list]:
    """cache -> (arrays by name, layer descriptors).  Raises :class:`Unsupported`."""
    arrays: dict = {}
    layers = [_ser_layer(c, f"l{i}.", arrays) for i, c in enumerate(cache)]
    return arrays, layers


def _get_arrays(arrays: dict, d):
    if d is None:
        return None
    if isinstance(d, str):
        return arrays[d]
    seq = [arrays[n] for n in d["names"]]
    return tuple(seq) if d["seq"] == "tuple" else seq


def _de_layer(desc: dict, arrays: dict):
    kind = desc["kind"]
    if kind == _QROT:
        return _de_qrot(desc, arrays)
    cls = _resolve(desc["cls"], kind)
    obj = cls.__new__(cls)
    for k, v in desc["attrs"].items():
        setattr(obj, k, v)
    if kind == "CacheList":
        kids = [_de_layer(c, arrays) for c in desc["children"]]
        obj.caches = tuple(kids) if desc.get("tuple") else kids
        return obj
    a = desc["arrays"]
    if kind == "ArraysCache":
        obj.cache = [_get_arrays(arrays, d) for d in a["cache"]]
        obj.left_padding = _get_arrays(arrays, a.get("left_padding"))
        obj.lengths = _get_arrays(arrays, a.get("lengths"))
        return obj
    obj.keys = _get_arrays(arrays, a["keys"])
    obj.values = _get_arrays(arrays, a["values"])
    if not isinstance(obj.offset, int) or obj.offset < 0:
        raise Corrupt("bad offset")
    if obj.keys is not None:
        first = obj.keys[0] if isinstance(obj.keys, (list, tuple)) else obj.keys
        need = obj.offset - getattr(obj, "start_position", 0)
        if kind == "RotatingKVCache":
            need = min(need, obj.max_size)
        if first.shape[-2] < need:
            raise Corrupt("arrays shorter than offset")
    return obj


def deserialize_cache(arrays: dict, layers: list) -> list:
    """Inverse of :func:`serialize_cache` (arrays as loaded by ``mx.load``)."""
    try:
        return [_de_layer(d, arrays) for d in layers]
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        raise Corrupt(f"bad layer data: {e}") from e
