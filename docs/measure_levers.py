"""Measure two codec levers kvplugin does not ship (docs/benchmarks.md, "Outlier key channels
and non-uniform levels"): a few key channels kept at fp16, and non-uniform (Lloyd) levels.

Not part of the package and imported by nothing: it patches the codec from outside for one
bench process, so the measured levers cost the engine no code. Two modes:

    python docs/measure_levers.py quality [kvplugin bench --quality --real-model options]
    python docs/measure_levers.py restore [rounds]
    python docs/measure_levers.py state BITS [kvplugin bench --quality --hybrid options]
    python docs/measure_levers.py restore-wide [rounds] [bits]

``quality`` runs the real-model codec bench; a codec spec may start with lever tokens, each
followed by ``~``:

* ``outN``: per layer and KV head, the N key channels of the largest range over the layer's
  rows (in the basis the codec quantizes: pre-RoPE where the spec says so, before the
  Hadamard) stored fp16 (their bytes counted) and set to their mean in the quantized keys;
  put back after the rotation is undone, before the RoPE goes back; ``outabsN`` the same,
  the channels of the largest magnitude (max |k|) instead;
* ``nuk`` / ``nuv`` / ``nukv``: keys / values / both quantized to Lloyd levels instead of
  uniform ones: levels for groups of 64 Gaussian values normalised to the group's
  [minimum, maximum] (scale-only values: to its [-max|x|, max|x|]), both ends kept as levels
  so that a group's extremes stay exact; the same scale and minimum are stored, so the
  bytes are today's; the restore looks each code's level up;
* ``gkN`` / ``gvN``: plain (unbounded, global) layers' keys / values at N bits, the rings' as
  the spec says (bits per layer);
* ``ktN``: per-channel keys in groups of N tokens, values in the spec's groups along the head
  (the spec's ``gG`` is both today).

``restore`` times ``dequantize_entry`` on a SmolLM2-shaped fp16 entry (30 layers x 3 KV heads
x 64; 1,200 tokens plain, or rings of 512 wrapped) at the 4-bit default, today's numpy
restore against the same with the level lookups (keys, keys and values) or N fp16 key
channels written back, interleaved, in ms per MiB of fp16 entry.

``restore-wide`` times the quantize and the restore of a Gemma-3-shaped entry (15 rings of 512 and 3 plain
layers of 1,200 tokens, 1 KV head x 256) at the 4-bit default of heads that wide (5-bit keys,
groups of 128) against 4-bit keys in groups of 64, interleaved, in ms per MiB of fp16 entry;
with ``bits`` 3, the 3-bit default's (k4v2 in groups of 128 against k3v3 in groups of 64);
with ``bits`` 8, the 8-bit default of entries with a window (``rotated-channel``) against
``affine``.

``state`` runs the hybrid bench with recurrent state quantized at ``BITS`` instead of 8 (its
rows still say "8-bit" for the quantized state).
"""

from __future__ import annotations

import sys
import time
from functools import lru_cache

import mlx.core as mx
import numpy as np

from kvplugin.cache.codec import channel, cpu_dequantize, prerope, rotating, rotation, rows
from kvplugin.cache.codec import quantize as qz
from kvplugin.codecs import CHANNEL_KEYS, SYM, VALUE_BITS_ATTR
from kvplugin.tools.bench import codec_quality as cq

STATE: dict = {}
OUT_ATTR, LEVELS_ATTR = "measured_outlier_keys", "measured_levels"


def _reset() -> None:
    STATE.update(out=0, nuk=False, nuv=False, stash=None, gk=0, gv=0, absmax=False, kt=0)


_reset()


@lru_cache(maxsize=None)
def levels(bits: int, sym: bool, group: int = 64) -> np.ndarray:
    """Lloyd levels (ascending, float32) of range-normalised Gaussian groups: ``[0, 2**bits-1]``
    (affine: minimum and scale), or ``[-half, half]`` (scale only); both ends fixed."""
    x = np.random.default_rng(0).standard_normal((20000, group))
    top = (1 << bits) - 1
    if sym:
        u, lo = x / np.abs(x).max(axis=1, keepdims=True) * top / 2, -top / 2
    else:
        low, high = x.min(1, keepdims=True), x.max(1, keepdims=True)
        u, lo = (x - low) / (high - low) * top, 0.0
    u = u.ravel()
    lv = np.linspace(lo, lo + top, top + 1)
    for _ in range(200):
        code = np.searchsorted((lv[1:] + lv[:-1]) / 2, u)
        for j in range(1, top):
            if (code == j).any():
                lv[j] = u[code == j].mean()
    if sym:
        lv = (lv - lv[::-1]) / 2
    return lv.astype(np.float32)


def _table(bits: int, sym: bool, nonuniform: bool) -> np.ndarray:
    if nonuniform:
        return levels(bits, sym)
    top = (1 << bits) - 1
    return np.arange(top + 1, dtype=np.float32) - (top / 2 if sym else 0)


def _nearest(u: mx.array, table: np.ndarray) -> mx.array:
    code = mx.zeros(u.shape, dtype=mx.uint8)
    for mid in ((table[1:] + table[:-1]) / 2).tolist():
        code = code + (u > mid).astype(mx.uint8)
    return code


def _channels_nu(x: mx.array, group: int, bits: int) -> tuple:
    """``channel.quantize_channels`` with Lloyd levels."""
    *lead, n, width = x.shape
    r = channel.scale_rows(n, group)
    padded = x if r * group == n else mx.concatenate(
        [x, mx.repeat(x[..., -1:, :], r * group - n, axis=-2)], axis=-2)
    g = padded.reshape(*lead, r, group, width)
    low, high = g.min(axis=-2).astype(mx.float32), g.max(axis=-2).astype(mx.float32)
    scales = ((high - low) / ((1 << bits) - 1)).astype(x.dtype)
    mins = low.astype(x.dtype)
    step = scales.astype(mx.float32)[..., None, :]
    u = (g.astype(mx.float32) - mins.astype(mx.float32)[..., None, :]) / mx.where(step > 0, step, 1)
    codes = _nearest(u, levels(bits, False)).reshape(*lead, r * group, width)[..., :n, :]
    return channel.pack_codes(codes, bits), scales, mins


def _tokens_nu(x: mx.array, group: int, bits: int, sym: bool) -> tuple:
    """Per-token groups (``mx.quantize``'s layout, or scale-only) with Lloyd levels."""
    *lead, width = x.shape
    g = x.astype(mx.float32).reshape(*lead, width // group, group)
    top = (1 << bits) - 1
    if sym:
        scales = (mx.abs(g).max(axis=-1) / (top / 2)).astype(x.dtype)
        base = mx.zeros(scales.shape)
    else:
        low = g.min(axis=-1)
        scales, base = ((g.max(axis=-1) - low) / top).astype(x.dtype), low.astype(x.dtype)
    step = scales.astype(mx.float32)[..., None]
    u = (g - base.astype(mx.float32)[..., None]) / mx.where(step > 0, step, 1)
    codes = channel.pack_codes(_nearest(u, levels(bits, sym)).reshape(x.shape), bits)
    return (codes, scales) if sym else (codes, scales, base)


def _outliers(keys: mx.array, count: int) -> tuple[mx.array, tuple]:
    k = keys.astype(mx.float32)
    size = mx.abs(k).max(axis=-2) if STATE["absmax"] else k.max(axis=-2) - k.min(axis=-2)
    idx = mx.argsort(-size, axis=-1)[..., :count]
    picked = (mx.arange(keys.shape[-1]) == idx[..., None]).any(axis=-2)
    kept = mx.where(picked[..., None, :], k.mean(axis=-2, keepdims=True), k).astype(keys.dtype)
    cols = mx.take_along_axis(keys, mx.broadcast_to(idx[..., None, :], (*keys.shape[:-1], count)),
                              axis=-1).astype(mx.float16)
    return kept, (idx.astype(mx.uint8), cols)


_encode, _restore = rows.encode_rows, rows.restore_rows
_quantize_rotating, _quantize_layer = rotating.quantize_rotating, qz._quantize_layer


def _active() -> bool:
    return bool(STATE["out"] or STATE["nuk"] or STATE["nuv"])


def encode_rows(keys, values, codec, bits, vbits, group, chunk_bytes):
    if not _active() or codec not in CHANNEL_KEYS:
        return _encode(keys, values, codec, bits, vbits, group, chunk_bytes)
    if STATE["out"]:
        keys, STATE["stash"] = _outliers(keys, STATE["out"])
    k, v = rotation.rotate(keys), rotation.rotate(values)
    kp = (_channels_nu if STATE["nuk"] else channel.quantize_channels)(k, group, bits)
    if STATE["nuv"]:
        vp = _tokens_nu(v, group, vbits, codec == SYM)
    elif codec == SYM:
        from kvplugin.cache.codec.symmetric import quantize_symmetric

        vp = quantize_symmetric(v, group, vbits)
    else:
        vp = mx.quantize(v, group_size=group, bits=vbits)
    return tuple(kp), tuple(vp)


def _tagged(q):
    if STATE["stash"] is not None:
        setattr(q, OUT_ATTR, STATE["stash"])  # counted in the stored bytes
        STATE["stash"] = None
    if _active():
        setattr(q, LEVELS_ATTR, (STATE["nuk"], STATE["nuv"]))
    return q


def _f32(x) -> np.ndarray:
    return np.asarray(x.astype(mx.float32))


def restore_rows(layer, codec, seed, n, dtype, rope=None, runs=None):
    """The codec's restore, in numpy, with the measured levels and outlier channels."""
    if not hasattr(layer, LEVELS_ATTR):
        return _restore(layer, codec, seed, n, dtype, rope, runs)
    nuk, nuv = getattr(layer, LEVELS_ATTR)
    vbits, g = getattr(layer, VALUE_BITS_ATTR, layer.bits), layer.group_size
    kept = [arrays[-1] if len(arrays) > rows.codec_arrays(codec, name) else None
            for name, arrays in (("keys", layer.keys), ("values", layer.values))]

    def codes(words, bits):
        return np.asarray(channel.unpack_codes(words[..., :n, :], bits)).astype(np.uint8)

    r = -(-n // g)
    keys = (_table(layer.bits, False, nuk)[codes(layer.keys[0], layer.bits)]
            * np.repeat(_f32(layer.keys[1])[..., :r, :], g, axis=-2)[..., :n, :]
            + np.repeat(_f32(layer.keys[2])[..., :r, :], g, axis=-2)[..., :n, :])
    vc = codes(layer.values[0], vbits)
    *lead, width = vc.shape
    v = (_table(vbits, codec == SYM, nuv)[vc].reshape(*lead, width // g, g)
         * _f32(layer.values[1])[..., :n, :, None])
    if codec != SYM:
        v = v + _f32(layer.values[2])[..., :n, :, None]
    keys = keys @ rotation._matrix(keys.shape[-1], seed).T
    values = v.reshape(*lead, width) @ rotation._matrix(width, seed).T
    out = getattr(layer, OUT_ATTR, None)
    if out is not None:
        idx, cols = np.asarray(out[0]).astype(np.int64), _f32(out[1])[..., :n, :]
        np.put_along_axis(keys, np.broadcast_to(idx[..., None, :], cols.shape), cols, axis=-1)
    if rope is not None:
        keys = prerope.turn_numpy(np.ascontiguousarray(keys, dtype=np.float32), rope, runs)
    from kvplugin.cache.codec.protected import restore_protected

    return tuple(mx.array(restore_protected(np.ascontiguousarray(x, dtype=np.float32),
                                            None if k is None else _f32(k), layer, n)).astype(dtype)
                 for x, k in zip((keys, values), kept))


def _plain_layer(layer, bits, group_size, codec="affine", value_bits=None, *a, **k):
    """A plain (unbounded, global) layer, its key / value bits as ``gkN`` / ``gvN`` say."""
    vbits = bits if value_bits is None else value_bits
    return _tagged(_quantize_layer(layer, STATE["gk"] or bits, group_size, codec,
                                   STATE["gv"] or vbits, *a, **k))


_parse = cq.parse_codec


def parse_codec(spec: str) -> dict:
    *tokens, base = spec.split("~")
    _reset()
    for t in tokens:
        if t.startswith("out") and t[3:].isdigit():
            STATE["out"] = int(t[3:])
        elif t.startswith("outabs") and t[6:].isdigit():
            STATE["out"], STATE["absmax"] = int(t[6:]), True
        elif t[:2] in ("gk", "gv") and t[2:].isdigit():
            STATE[t[:2]] = int(t[2:])
        elif t.startswith("kt") and t[2:].isdigit():
            STATE["kt"] = int(t[2:])
        elif t in ("nuk", "nuv", "nukv"):
            STATE["nuk"] = STATE["nuk"] or "k" in t[2:]
            STATE["nuv"] = STATE["nuv"] or "v" in t[2:]
        else:
            raise ValueError(f"unknown lever {t!r} in {spec!r}")
    return _parse(base)


class _Spec(str):
    """A spec whose suffix tests (``+prerope``) see the codec after the lever tokens."""

    def removesuffix(self, s):
        return _Spec(str.removesuffix(self, s))

    def endswith(self, s):
        return str.endswith(self.split("~")[-1], s)


def _key_groups() -> None:
    """Per-channel keys' token group as ``ktN`` says, wherever the codec groups keys."""
    def kt(group: int) -> int:
        return STATE["kt"] or group

    quant, dequant, rows_of = (channel.quantize_channels, channel.dequantize_channels,
                               channel.scale_rows)
    per_channel, chunks = cpu_dequantize._per_channel, rows.in_row_chunks
    channel.quantize_channels = lambda x, group, bits: quant(x, kt(group), bits)
    channel.dequantize_channels = lambda parts, n, group, bits, dtype: dequant(
        parts, n, kt(group), bits, dtype)
    channel.scale_rows = rotating.scale_rows = lambda tokens, group: rows_of(tokens, kt(group))
    cpu_dequantize._per_channel = lambda parts, n, group, bits: per_channel(
        parts, n, kt(group), bits)
    # row chunks end on a whole key group
    rows.in_row_chunks = lambda x, encode, chunk, group: chunks(
        x, encode, chunk, max(kt(group), group))


def install() -> None:
    _key_groups()
    rows.encode_rows = rotating.encode_rows = qz.encode_rows = encode_rows
    rows.restore_rows = rotating.restore_rows = qz.restore_rows = restore_rows
    rotating.quantize_rotating = lambda *a, **k: _tagged(_quantize_rotating(*a, **k))
    qz._quantize_layer = _plain_layer
    cq.parse_codec = parse_codec
    one = cq._one_prompt
    cq._one_prompt = lambda model, ids, plen, cont, specs, acc, **kw: one(
        model, ids, plen, cont, [_Spec(s) for s in specs], acc, **kw)


# ----------------------------------------------------------------------------- restore time


def restore_times(rounds: int) -> None:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from kvplugin.cache.layers import entry_nbytes
    from kvplugin.cache.model.rope import KeyRope

    mode = {"nuk": False, "nuv": False, "out": 0}
    per_token, per_channel, turn = (cpu_dequantize._per_token, cpu_dequantize._per_channel,
                                    prerope.turn_numpy)

    def token_levels(parts, n, group, bits):  # cpu_dequantize._per_token, codes looked up
        if not mode["nuv"]:
            return per_token(parts, n, group, bits)
        codes = cpu_dequantize._codes(parts[0], n, bits)
        *lead, width = codes.shape
        out = levels(bits, False)[codes].reshape(*lead, width // group, group)
        out *= cpu_dequantize._f32(parts[1])[..., :n, :, None]
        out += cpu_dequantize._f32(parts[2])[..., :n, :, None]
        return out.reshape(*lead, width)

    def channel_levels(parts, n, group, bits):  # cpu_dequantize._per_channel, looked up
        if not mode["nuk"]:
            return per_channel(parts, n, group, bits)
        codes = cpu_dequantize._codes(parts[0], n, bits)
        *lead, _, width = codes.shape
        r = -(-n // group)
        out = np.empty((*lead, r * group, width), np.float32)
        np.take(levels(bits, False), codes, out=out[..., :n, :], mode="clip")
        out[..., n:, :] = 0
        grouped = out.reshape(*lead, r, group, width)
        grouped *= cpu_dequantize._f32(parts[1])[..., :r, None, :]
        grouped += cpu_dequantize._f32(parts[2])[..., :r, None, :]
        return out[..., :n, :]

    def turned(x, rope, runs):
        if mode["out"]:
            c = mode["out"]
            idx = np.broadcast_to(np.arange(c), (*x.shape[:-1], c))
            np.put_along_axis(x, idx, np.zeros(idx.shape, np.float32), axis=-1)
        return turn(x, rope, runs)

    cpu_dequantize._per_token, cpu_dequantize._per_channel = token_levels, channel_levels
    prerope.turn_numpy = turned
    rope = KeyRope(dims=64, traditional=False, base=100000.0, scale=1.0)
    for kind in ("plain", "ring"):
        mx.random.seed(0)
        layers = []
        for _ in range(30):
            if kind == "plain":
                layer = KVCache()
                layer.update_and_fetch(*(mx.random.normal((1, 3, 1200, 64)).astype(mx.float16)
                                         for _ in "kv"))
            else:
                layer = RotatingKVCache(max_size=512, keep=4)
                for _ in range(4):
                    k = mx.random.normal((1, 3, 1, 64)).astype(mx.float16)
                    for _ in range(300):
                        layer.update_and_fetch(k, k)
            layers.append(layer)
        ropes = [rope] * 30
        q = qz.quantize_entry(layers, bits=4, group_size=64, codec="rotated-channel",
                              sink_tokens=4, recent_tokens=16, key_ropes=ropes).cache
        mib = entry_nbytes(layers) / 2**20
        names = {"today": {}, "nuk": {"nuk": True}, "nukv": {"nuk": True, "nuv": True},
                 "out2": {"out": 2}, "out4": {"out": 4}}
        times: dict = {name: [] for name in names}
        for _ in range(rounds):
            for name, change in names.items():
                mode.update({"nuk": False, "nuv": False, "out": 0}, **change)
                t = time.perf_counter()
                back = qz.dequantize_entry(q, key_ropes=ropes[name])
                mx.eval([a for layer in back for a in (layer.keys, layer.values)])
                times[name].append((time.perf_counter() - t) * 1000 / mib)
        _print_times(times, "today", lambda name: f"{kind:5s} {name:5s}")


def _print_times(times: dict, base_name: str, label) -> None:
    """Best and median ms/MiB per name, and their ratio to ``base_name``'s."""
    base = sorted(times[base_name])
    for name, xs in times.items():
        xs.sort()
        mid = len(xs) // 2
        print(f"{label(name)} best {xs[0]:.2f} median {xs[mid]:.2f} ms/MiB, x {base_name}: "
              f"best {xs[0] / base[0]:.2f} median {xs[mid] / base[mid]:.2f}")


#: per ``restore-wide`` bits: the default before the window rule, then with it, each as
#: (codec, recent tokens kept, (key bits, value bits, group), keys pre-RoPE)
WIDE_PAIRS = {4: (("rotated-channel", 16, (4, 4, 64), True),
                  ("rotated-channel", 16, (5, 4, 128), True)),
              3: ((SYM, 6, (3, 3, 64), False), (SYM, 6, (4, 2, 128), False)),
              8: (("affine", 0, (8, 8, 64), False), ("rotated-channel", 0, (8, 8, 64), False))}


def wide_restore_times(rounds: int, bits: int = 4) -> None:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from kvplugin.cache.layers import entry_nbytes
    from kvplugin.cache.model.rope import KeyRope

    mx.random.seed(0)
    layers = []
    for i in range(18):
        if i % 6 == 5:
            layer = KVCache()
            layer.update_and_fetch(*(mx.random.normal((1, 1, 1200, 256)).astype(mx.float16)
                                     for _ in "kv"))
        else:
            layer = RotatingKVCache(max_size=512, keep=0)
            layer.update_and_fetch(*(mx.random.normal((1, 1, 600, 256)).astype(mx.float16)
                                     for _ in "kv"))
            for _ in range(600):
                k = mx.random.normal((1, 1, 1, 256)).astype(mx.float16)
                layer.update_and_fetch(k, k)
        layers.append(layer)
    rope = [KeyRope(dims=256, traditional=False, base=10000.0, scale=1.0)] * 18
    mib = entry_nbytes(layers) / 2**20
    mx.eval([a for layer in layers for a in (layer.keys, layer.values)])
    stored, ropes, codecs = {}, {}, {}
    quantize_times: dict = {}
    for codec, recent, (kb, vb, g), prerope in WIDE_PAIRS[bits]:
        name = f"{codec}-k{kb}v{vb}-g{g}"
        ropes[name], quantize_times[name] = (rope if prerope else None), []
        codecs[name] = dict(bits=kb, value_bits=vb, group_size=g, codec=codec,
                            sink_tokens=4 if recent else 0, recent_tokens=recent)
    times: dict = {name: [] for name in codecs}
    for _ in range(rounds):
        for name, kwargs in codecs.items():
            t = time.perf_counter()
            stored[name] = qz.quantize_entry(layers, key_ropes=ropes[name], **kwargs).cache
            mx.eval([(layer.keys, layer.values) for layer in stored[name]])
            quantize_times[name].append((time.perf_counter() - t) * 1000 / mib)
            t = time.perf_counter()
            back = qz.dequantize_entry(stored[name], key_ropes=ropes[name])
            mx.eval([a for layer in back for a in (layer.keys, layer.values)])
            times[name].append((time.perf_counter() - t) * 1000 / mib)
    first = next(iter(codecs))
    print("restore:")
    _print_times(times, first, lambda name: f"{name} "
                 f"({entry_nbytes(stored[name]) / 2**20 / mib:.3f}x fp16)")
    print("quantize:")
    _print_times(quantize_times, first, str)

if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "restore":
        restore_times(int(rest[0]) if rest else 9)
    elif mode == "restore-wide":
        wide_restore_times(int(rest[0]) if rest else 9, int(rest[1]) if len(rest) > 1 else 4)
    elif mode == "state":
        from kvplugin.cache.codec import state
        from kvplugin.tools.bench import state_quality

        state.STATE_BITS = int(rest[0])
        state.quantize_state.__defaults__ = (state.STATE_BITS,)
        sys.exit(state_quality.main(["--quality", "--hybrid", *rest[1:]]))
    else:
        install()
        sys.exit(cq.main(rest))
