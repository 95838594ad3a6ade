"""Is a fetched entry one this model can run with? Checked before an entry reaches a host.

Why: a digest proves a file holds what was written, not that it fits the model that reads it
(a file written by another build, planted or mislabelled). An entry whose layers have the
wrong count, kind, dtype or width is accepted by the host and fails later, deep in its
generation loop (mlx-lm's batched path dies in ``concatenate`` and takes the generation
thread with it). So every fetched entry is compared with the model's **reference**: the
model's own fresh cache after one token of forward pass, computed once per model, which
gives each layer's kind and every array's dtype and shape except the token axis. No model
config is parsed: whatever the model's cache really looks like is the reference.

Kinds compare by family: any attention layout (``KVCache``, ``QuantizedKVCache``,
``RotatingKVCache``, ``ChunkedKVCache``, ``ConcatenateKVCache``) may stand for another
(``--max-kv-size`` makes rotating layers, ``--kv-bits`` quantized ones), except where the
model itself makes a rotating layer (a sliding window): then the entry's must be rotating
with the same window. Recurrent (``ArraysCache``) and nested (``CacheList``) layers must be
the same kind, recursively.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from kvplugin.cache.layers import layout_of
from kvplugin.cache.codec.quantize import VALUE_BITS_ATTR, codec_arrays
from kvplugin.codecs import CODEC_ATTR

__all__ = ["ModelChecker", "Reference", "entry_problem", "reference_of"]

log = logging.getLogger("kvplugin.cache")

_ATTENTION = {"KVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache",
              "ConcatenateKVCache"}


@dataclass(frozen=True)
class Reference:
    """One layer of the model's fresh cache: family, window, and per-field array specs
    (``(dtype, shape)``, the token axis of attention arrays given as ``None``)."""

    family: str
    max_size: int | None = None
    arrays: dict = field(default_factory=dict)
    children: tuple = ()


def _layout(layer: Any) -> str | None:
    """The vocabulary's layout; kvplugin's own quantized window counts as a rotating one."""
    from kvplugin.cache.codec.rotating import QuantizedRotatingKVCache

    if isinstance(layer, QuantizedRotatingKVCache):
        return "RotatingKVCache"
    return layout_of(layer)


def _family(layer: Any) -> str | None:
    kind = _layout(layer)
    if kind in _ATTENTION:
        return "attention"
    return {"ArraysCache": "arrays", "CacheList": "list"}.get(kind or "")


def _spec(a: Any, token_axis: bool) -> tuple | None:
    if not isinstance(a, mx.array):
        return None
    shape = list(a.shape)
    if token_axis and len(shape) >= 2:
        shape[-2] = None
    return (a.dtype, tuple(shape))


def _ref_layer(layer: Any) -> Reference:
    fam = _family(layer)
    if fam == "list":
        return Reference("list", children=tuple(_ref_layer(c) for c in layer.caches))
    if fam == "arrays":
        return Reference("arrays", arrays={j: _spec(a, False) for j, a in enumerate(layer.cache)})
    if fam == "attention":
        window = layer.max_size if layout_of(layer) == "RotatingKVCache" else None
        return Reference("attention", window, {"keys": _spec(layer.keys, True),
                                               "values": _spec(layer.values, True)})
    return Reference(type(layer).__name__)


def reference_of(model: Any) -> list[Reference]:
    """The reference of ``model``: a new cache from the model's own maker (what mlx-lm's
    ``make_prompt_cache`` makes without a bound) after a one-token forward pass, so every
    layer has arrays of the real dtype and widths."""
    if hasattr(model, "make_cache"):
        fresh = list(model.make_cache())
    else:
        from mlx_lm.models.cache import KVCache

        fresh = [KVCache() for _ in model.layers]
    model(mx.array([[0]]), cache=fresh)
    mx.eval([getattr(c, "state", None) for c in fresh if getattr(c, "state", None) is not None])
    return [_ref_layer(c) for c in fresh]


def _attention_problem(layer: Any, ref: Reference, where: str) -> str | None:
    kind = _layout(layer)
    if ref.max_size is not None and (kind != "RotatingKVCache"
                                     or getattr(layer, "max_size", None) != ref.max_size):
        return f"{where}: the model keeps a window of {ref.max_size} tokens here, the entry " \
               f"a {kind}"
    bits = getattr(layer, "bits", None)
    for name in ("keys", "values"):
        want = ref.arrays.get(name)
        got = getattr(layer, name, None)
        if want is None or got is None:
            continue
        dtype, shape = want
        if bits is not None:  # (packed uint32, scales[, biases][, protected rows]): widths
            held = codec_arrays(getattr(layer, CODEC_ATTR, "affine"), name)  # in packed words
            if not isinstance(got, (list, tuple)) or len(got) not in (held, held + 1):
                return f"{where}.{name}: not the codec's {held} quantized arrays"
            if name == "values":
                bits = getattr(layer, VALUE_BITS_ATTR, bits)
            kept = got[-1] if len(got) > held else None
            if kept is not None and (kept.dtype != dtype or kept.shape[:-2] != shape[:-2]
                                     or kept.shape[-1] != shape[-1]):
                return f"{where}.{name}: protected rows {tuple(kept.shape)}/{kept.dtype} " \
                       f"for a model whose {name} are {shape}/{dtype}"
            packed, scales = got[0], got[1]
            width = packed.shape[-1] * 32 // int(bits)
            if (packed.ndim != len(shape) or packed.shape[:-2] != shape[:-2]
                    or width != shape[-1] or scales.dtype != dtype):
                return (f"{where}.{name}: quantized {tuple(packed.shape)}/{scales.dtype} for "
                        f"a model whose {name} are {shape}/{dtype}")
            continue
        if not isinstance(got, mx.array):
            return f"{where}.{name}: not an array"
        if (got.ndim != len(shape) or got.dtype != dtype
                or any(w is not None and g != w for g, w in zip(got.shape, shape))):
            return f"{where}.{name}: {tuple(got.shape)}/{got.dtype} for a model whose " \
                   f"{name} are {shape}/{dtype} (None: tokens)"
    return None


def _layer_problem(layer: Any, ref: Reference, where: str) -> str | None:
    fam = _family(layer)
    if fam != ref.family:
        return f"{where}: a {type(layer).__name__} where the model has a {ref.family} layer"
    if fam == "attention":
        return _attention_problem(layer, ref, where)
    if fam == "list":
        kids = list(layer.caches)
        if len(kids) != len(ref.children):
            return f"{where}: {len(kids)} nested layers, the model {len(ref.children)}"
        for j, (c, r) in enumerate(zip(kids, ref.children)):
            problem = _layer_problem(c, r, f"{where}.{j}")
            if problem:
                return problem
        return None
    if fam == "arrays":
        state = list(layer.cache)
        if len(state) != len(ref.arrays):
            return f"{where}: {len(state)} state arrays, the model {len(ref.arrays)}"
        for j, a in enumerate(state):
            want = ref.arrays.get(j)
            if a is None or want is None:
                continue
            if isinstance(a, (tuple, list)):  # stored quantized (kvplugin.cache.codec.state)
                bits = getattr(layer, "bits", None)
                if not (isinstance(bits, int) and len(a) == 3
                        and all(isinstance(p, mx.array) for p in a)
                        and a[1].dtype == want[0] and a[0].ndim == len(want[1])
                        and tuple(a[0].shape[:-2]) == want[1][:-2]  # rows may be regrouped
                        and a[0].shape[-2] * a[0].shape[-1] * 32
                        == want[1][-2] * want[1][-1] * bits):
                    return f"{where}.{j}: quantized state for a model whose state is " \
                           f"{want[1]}/{want[0]}"
                continue
            if not isinstance(a, mx.array) or (a.dtype, tuple(a.shape)) != want:
                return f"{where}.{j}: {getattr(a, 'shape', None)} for a model whose state is " \
                       f"{want[1]}/{want[0]}"
    return None


def entry_problem(entry: list, reference: list[Reference]) -> str | None:
    """Why ``entry`` cannot be handed to the model ``reference`` describes, or ``None``."""
    if not isinstance(entry, list) or len(entry) != len(reference):
        n = len(entry) if isinstance(entry, list) else type(entry).__name__
        return f"{n} layers for a model of {len(reference)}"
    for i, (layer, ref) in enumerate(zip(entry, reference)):
        problem = _layer_problem(layer, ref, f"layer {i}")
        if problem:
            return problem
    return None


class ModelChecker:
    """Entries checked against the models a process serves: each model's reference is
    computed once (a one-token forward pass) and held by a weak reference, so a model the
    host unloads is never kept alive. A model whose reference cannot be computed is said once
    and not checked (served as before)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._references: dict[int, tuple[Any, Any]] = {}

    def _reference(self, model: Any) -> Any:
        with self._lock:
            held = self._references.get(id(model))
        if held is not None and held[0]() is model:
            return held[1]
        try:
            ref = reference_of(model)
        except Exception as exc:  # an exotic model: say so once, serve as before
            from kvplugin.log import say

            say(f"cannot check fetched entries against {type(model).__module__} "
                f"({type(exc).__name__}: {exc})", key=f"validate-ref:{type(model)}")
            ref = None
        try:
            alive = weakref.ref(model)
        except TypeError:
            alive = lambda: model  # noqa: E731  (no weak references: keep it)
        with self._lock:
            self._references = {k: v for k, v in self._references.items() if v[0]() is not None}
            self._references[id(model)] = (alive, ref)
        return ref

    def problem(self, model: Any, entry: list) -> str | None:
        """Why ``entry`` does not fit ``model``, or None (also when it cannot be checked)."""
        ref = self._reference(model)
        if ref is None:
            return None
        try:
            return entry_problem(entry, ref)
        except Exception as exc:  # data too odd to even compare is not used either
            return f"{type(exc).__name__}: {exc}"
