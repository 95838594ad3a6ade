"""Which codec a quantized entry is stored with: the names and ``auto``'s choice.

Why a module of its own: the settings (no MLX imported), the default quantize hook, the
remote tier's namespace and ``/kvplugin/stats`` all need the same resolved answer to "what
does ``--kv-cache-codec auto`` with these bits mean", so it is decided once, here.

``auto`` (the default) is what ``kvplugin bench --quality --real-model`` and a real server's
chat measured best (docs/benchmarks.md, SmolLM2-135M): below 6 key bits, keys rotated and
quantized per channel (``rotated-channel``) with the first 4 tokens (attention sinks) and the
last 16 kept at full precision lose several times less than ``affine`` at the same size. From
6 bits on plain ``affine``: ``rotated-channel`` 8-bit is closer in one round trip, but a real
server's multi-turn chat, where an entry is dequantized and quantized again at every turn,
kept every answer with ``affine`` only, and ``affine`` dequantizes in half the time. At 3 bits
and below ``rotated-channel-sym``: the same keys, values stored with a scale and no minimum,
and 6 recent tokens, the size class that 3 bits are chosen for. At 4 and 3 bits, on heads a group
of 128 divides, keys take one bit more, paid for by scales over groups of 128 (and at 3 bits
by a value bit: :data:`WIDE_HEADS`): on a real sliding-window model (Gemma 3, heads of 256)
that halved the error at 4 bits and kept 7 of 8 chat answers where 4-bit keys kept 5, and at
3 bits lowered it by a third at a smaller size. As pre-RoPE keys, this is for entries with a
sliding-window or ``--max-kv-size`` layer (every layer of them): entries of plain layers only
met the 4-bit goals with 4-bit keys. So is 8 bits' ``rotated-channel`` (:data:`WINDOW_CODECS`),
which entries with recurrent state (hybrids) take too. At 4 bits, in an entry with a window,
the layer in ten whose keys the codec quantizes worst takes 6-bit keys, paid for by a key bit
fewer on the best-quantized (:data:`RANKED_KEYS`): a few layers' keys carry most of the
error there (bounded SmolLM2: KL -36% at the same bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CODECS", "CHANNEL_KEYS", "CHOICES", "SYM", "PRE_ROPE", "PREROPE_CODECS",
           "CODEC_ATTR", "SEED_ATTR", "VALUE_BITS_ATTR", "CodecPlan", "UnknownCodec",
           "codec_plan", "fitting_codec", "layer_bits_group", "WIDE_HEADS", "WINDOW_CODECS",
           "RANKED_KEYS"]

CODECS = ("affine", "rotated", "rotated-channel", "rotated-channel-sym")  # what
# kvplugin.cache.codec.quantize can read
CHOICES = ("auto",) + CODECS
SYM = "rotated-channel-sym"  # rotated-channel with scale-only values (kvplugin.cache.codec.symmetric)
CHANNEL_KEYS = ("rotated-channel", SYM)  # the codecs whose keys are per channel
#: What a stored layer records its codec and rotation seed under (scalar attributes, which
#: the SSD and remote formats carry); a layer without the codec attribute is ``affine``.
CODEC_ATTR = "kvplugin_codec"
SEED_ATTR = "kvplugin_codec_seed"
#: ... and its value bits where they differ from the keys' (``layer.bits``)
VALUE_BITS_ATTR = "kvplugin_value_bits"
#: ... and, on a stored ring whose protected slots are held at full precision only (not also
#: among the codes), the slots it restores to: the codes hold the others, in slot order
RING_SLOTS_ATTR = "kvplugin_ring_slots"
#: ``auto`` is ``affine`` from this many key bits on, ``rotated-channel`` below, and
#: ``rotated-channel-sym`` at or below :data:`AUTO_SYM_UP_TO_BITS`
AUTO_AFFINE_FROM_BITS = 6
AUTO_SYM_UP_TO_BITS = 3
#: Sink and recent tokens kept at full precision when not given, for the rotated codecs
#: below :data:`PROTECT_BELOW_BITS` (of the narrower of keys and values): they need the
#: sinks (whose huge keys otherwise set the range of a whole group). ``affine``: none.
PROTECTED_DEFAULT = (4, 16)
PROTECT_BELOW_BITS = 6
#: ... and for ``rotated-channel-sym``, whose point is size: 6 recent rows (docs/benchmarks.md)
SYM_PROTECTED_DEFAULT = (4, 6)
#: ``auto``'s default of these bits on heads the group divides: (key bits, value bits, group)
#: (docs/benchmarks.md, "Five-bit keys and larger key groups"); narrower heads keep the bits
#: and groups of 64
WIDE_HEADS = {4: (5, 4, 128), 3: (4, 2, 128)}
#: ``auto``'s key bits at these bits, in an entry with a window, for the one layer in ten
#: whose keys the codec quantizes worst, paid for by a key bit fewer on those it quantizes
#: best (:mod:`kvplugin.cache.codec.ranked`; docs/benchmarks.md, "Key bits by layer")
RANKED_KEYS = {4: 6}
#: ``auto``'s codec of these bits for an entry with a window or recurrent state, where
#: entries of plain layers only take ``affine``: on Gemma 3, 8-bit ``affine`` missed the 8-bit
#: goals (top-1 99.58%, KL 2.8e-4) and ``rotated-channel`` met them (99.90%, 2.5e-5), as on
#: the trained tiny hybrid with its state at 8 bits (99.95% where ``affine`` read 99.76%);
#: a plain model's chat kept every answer with ``affine`` only (docs/benchmarks.md, "Eight
#: bits in entries with a window or recurrent state")
WINDOW_CODECS = {8: "rotated-channel"}
#: What a codec's name ends with where its keys are stored pre-RoPE
PRE_ROPE = "+prerope"
#: The codecs whose keys ``--kv-cache-prerope-keys`` stores pre-RoPE (on rotating layers:
#: docs/benchmarks.md, "Pre-RoPE keys"); ``rotated-channel-sym`` measured worse with them
PREROPE_CODECS = ("rotated-channel",)


class UnknownCodec(ValueError):
    """A stored layer names a codec (or parameters) this kvplugin cannot decode: a miss."""


@dataclass(frozen=True)
class CodecPlan:
    """A resolved codec: what :func:`kvplugin.cache.codec.quantize.quantize_entry` is called with."""

    codec: str
    key_bits: int | None
    value_bits: int | None
    group_size: int
    sink_tokens: int
    recent_tokens: int
    quantize_state: bool = True  # recurrent state rotated at 8 bits (cache/codec/state.py)
    #: rotating layers' keys stored pre-RoPE where their rope is known (cache/codec/prerope.py)
    prerope_keys: bool = False
    #: (key bits, value bits, group) on layers whose heads that group divides, in entries
    #: with a window (:func:`layer_bits_group`)
    wide_head_keys: tuple[int, int, int] | None = None
    #: the codec of entries with a window or recurrent state, where it is not :attr:`codec`
    #: (keys post-RoPE, the same bits and protections: :data:`WINDOW_CODECS`)
    window_codec: str | None = None
    #: key bits of the worst-quantized layers in entries with a window (:data:`RANKED_KEYS`)
    ranked_key_bits: int | None = None

    def codec_for(self, plain: bool) -> str:
        """The codec of an entry of plain layers only (``plain``) or of one with a window or
        recurrent state."""
        return self.window_codec if not plain and self.window_codec else self.codec

    @property
    def name(self) -> str:
        """As stored layers name it (``codec_name``), e.g. ``rotated-channel-k4v4-s4r16``,
        ``+prerope`` where keys are stored pre-RoPE."""
        extra = (f"-s{self.sink_tokens}r{self.recent_tokens}"
                 if self.sink_tokens or self.recent_tokens else "")
        pre = PRE_ROPE if self.prerope_keys else ""
        return f"{self.codec}-k{self.key_bits}v{self.value_bits}{extra}{pre}"

    @property
    def description(self) -> str:
        """:attr:`name`, and what entries with a window (or recurrent state) take instead
        (:attr:`window_codec`, or ``wide_head_keys`` on heads its group divides)."""
        if self.window_codec:
            return (f"{self.name} ({self.window_codec} in entries with a window or "
                    "recurrent state)")
        ranked = (f"{self.ranked_key_bits}-bit keys on the worst-quantized layer in ten, "
                  "paid for by the best-quantized" if self.ranked_key_bits else "")
        if not self.wide_head_keys:
            return f"{self.name} ({ranked}, in entries with a window)" if ranked else self.name
        kbits, vbits, group = self.wide_head_keys
        return (f"{self.name} (k{kbits}v{vbits} in groups of {group} on heads it "
                f"divides, in entries with a window{'; there, ' + ranked if ranked else ''})")


def codec_plan(settings: Any) -> CodecPlan:
    """The codec ``settings`` ask for, ``auto`` and unset protections resolved."""
    bits = settings.kv_cache_quantization_bits
    key_bits = settings.kv_cache_key_bits or bits
    value_bits = settings.kv_cache_value_bits or bits
    codec = settings.kv_cache_codec
    if codec == "auto":
        codec = ("affine" if key_bits >= AUTO_AFFINE_FROM_BITS else
                 "rotated-channel-sym" if max(key_bits, value_bits) <= AUTO_SYM_UP_TO_BITS
                 else "rotated-channel")
    protect = codec != "affine" and min(key_bits, value_bits) < PROTECT_BELOW_BITS
    sink, recent = ((SYM_PROTECTED_DEFAULT if codec == "rotated-channel-sym"
                     else PROTECTED_DEFAULT) if protect else (0, 0))
    if settings.kv_cache_sink_tokens is not None:
        sink = settings.kv_cache_sink_tokens
    if settings.kv_cache_recent_tokens is not None:
        recent = settings.kv_cache_recent_tokens
    prerope = codec in PREROPE_CODECS and getattr(settings, "kv_cache_prerope_keys", True)
    chosen = getattr(settings, "model_fields_set", set())  # what the user gave explicitly
    auto_bits = (settings.kv_cache_codec == "auto"
                 and not (settings.kv_cache_key_bits or settings.kv_cache_value_bits))
    wide = (WIDE_HEADS.get(bits) if auto_bits
            and "kv_cache_quantization_group_size" not in chosen else None)
    return CodecPlan(codec, key_bits, value_bits,
                     settings.kv_cache_quantization_group_size, sink, recent,
                     getattr(settings, "kv_cache_quantize_state", True), prerope, wide,
                     WINDOW_CODECS.get(bits) if auto_bits else None,
                     RANKED_KEYS.get(bits) if auto_bits else None)


def layer_bits_group(key_bits: int, value_bits: int, group: int,
                     wide_head_keys: tuple[int, int, int] | None,
                     key_width: int, value_width: int) -> tuple[int, int, int]:
    """One layer's key bits, value bits and group: ``wide_head_keys`` where its group divides
    both widths, else the entry's."""
    if wide_head_keys and not (key_width % wide_head_keys[2] or value_width % wide_head_keys[2]):
        return wide_head_keys
    return key_bits, value_bits, group


def fitting_codec(codec: str, key_width: int, value_width: int) -> str:
    """``codec``, or what layers of these widths can take: the rotated codecs need
    power-of-two widths (a Hadamard; ``affine`` otherwise), per-channel keys a multiple of 32
    (``rotated`` otherwise). ``auto`` falls back so, silently; a codec the user named is
    refused at start-up where it would fall back (``kvplugin.cache.service.startup_checks``)."""
    def power_of_two(w: int) -> bool:
        return w > 0 and w & (w - 1) == 0

    if codec != "affine" and not (power_of_two(key_width) and power_of_two(value_width)):
        return "affine"
    if codec in ("rotated-channel", "rotated-channel-sym") and key_width % 32:
        return "rotated"
    return codec
