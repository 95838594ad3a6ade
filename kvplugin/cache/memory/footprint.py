"""Admission control: a request the process cannot hold is refused before its prefill.

Why: on a Mac, a prefill that does not fit in memory is Metal's out-of-memory abort, which
kills every conversation on the server. A clear refusal of one request is better: 413 when it
can never fit, 503 with ``Retry-After`` when requests in flight hold the memory it needs.

What is counted is MLX's memory as MLX counts it (weights, stored entries, live caches). A
request *needs* (an upper bound, estimated from the model's own cache layers, see
:class:`Footprint`):

- its KV cache when it ends: KV bytes per token x (prompt + max_tokens), per layer, plus one
  growth step; a bounded layer (sliding window, ``--max-kv-size``) at most its window;
  recurrent state its fixed size; twice that on a batched path, where the host copies a
  request's cache into the batch;
- one prefill chunk's transient: the chunk's new KV, one layer's old buffer while it grows,
  the chunk's activations and its attention scores;
- with quantized entries, dequantizing the fetched entry: its full-precision size.

The ledger: ``base`` (what is neither a stored entry nor a request: weights, mostly) + the
reservations of requests in flight + this request's need must stay within the limit. Stored
entries never cause a refusal: the caller evicts them first (LRU, counted as pressure
evictions) and hands MLX's buffer cache back to the system.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AdmissionRefused",
    "Footprint",
    "Ledger",
    "Verdict",
    "probe_footprint",
]

#: Activation bytes per token and hidden unit in one layer's forward pass (attention
#: projections, MLP up/gate/down at up to ~4x hidden): a generous bound.
ACTIVATION_FACTOR = 16
#: Tokens a growing cache may hold beyond what it uses (mlx-lm's growth step).
GROWTH_SLACK = 256


@dataclass(frozen=True)
class LayerGrowth:
    """One cache layer's memory: ``fixed`` bytes + ``per_slot`` bytes per held token, held
    tokens at most ``cap`` (a window) when bounded."""

    per_slot: int
    fixed: int = 0
    cap: int | None = None

    def at(self, slots: int) -> int:
        n = slots if self.cap is None else min(slots, self.cap)
        return self.fixed + self.per_slot * n


@dataclass(frozen=True)
class Footprint:
    """A model's memory per request, from its own cache layers (see :func:`probe_footprint`)."""

    layers: tuple[LayerGrowth, ...]
    hidden: int = 0
    heads: int = 0
    itemsize: int = 4

    def kv_bytes(self, tokens: int) -> int:
        """The cache of a request holding ``tokens`` tokens, with one growth step of slack."""
        return sum(layer.at(tokens + GROWTH_SLACK) for layer in self.layers)

    def prefill_bytes(self, chunk: int, context: int) -> int:
        """The transient of one prefill chunk of ``chunk`` tokens at ``context`` tokens."""
        # layer by layer: its chunk's new keys/values (computed, then written), and its old
        # buffer while it grows into a new one
        new_kv = 2 * chunk * max((layer.per_slot for layer in self.layers), default=0)
        one_layer_old = max((layer.at(context) for layer in self.layers), default=0)
        activations = chunk * self.hidden * self.itemsize * ACTIVATION_FACTOR
        scores = self.heads * chunk * (context + chunk) * 4  # float32 scores, unfused
        return new_kv + one_layer_old + activations + scores

    def need(self, prompt: int, max_tokens: int, chunk: int, *, dequantize: bool,
             batched: bool = False) -> int:
        """Upper bound of what one request adds to the process's MLX memory.

        ``batched``: the request joins a batch; the host then holds its cache twice for a
        moment (its own, and the batch's copy when the batch is merged or extended).
        """
        total = prompt + max(0, max_tokens)
        kv = self.kv_bytes(total) * (2 if batched else 1)
        need = kv + self.prefill_bytes(min(chunk, max(prompt, 1)), prompt)
        if dequantize:
            need += self.kv_bytes(prompt)
        return need


def probe_footprint(model: Any, cache: list, tokens: list[int]) -> Footprint:
    """Run ``tokens`` (a few) through ``model`` with a fresh ``cache`` of the host's own
    classes and read each layer's bytes per token from what it then holds."""
    import mlx.core as mx

    from kvplugin.cache.layers import entry_arrays, growth_of
    from kvplugin.cache.model.widths import _configs, _field, _pos_int

    model(mx.array([tokens]), cache=cache)
    mx.eval(entry_arrays(cache))
    layers = tuple(LayerGrowth(per_slot=p, fixed=f, cap=c)
                   for layer in cache for p, f, c in growth_of(layer))
    hidden = heads = 0
    for cfg in _configs(model):
        hidden = hidden or _pos_int(_field(cfg, "hidden_size")) or 0
        heads = heads or _pos_int(_field(cfg, "num_attention_heads")) or 0
    arrays = entry_arrays(cache)
    itemsize = max((a.dtype.size for a in arrays), default=4)
    return Footprint(layers=layers, hidden=hidden, heads=heads, itemsize=itemsize)


@dataclass(frozen=True)
class Verdict:
    """An admission decision. ``status``: 200 admit, 413 never fits, 503 busy."""

    status: int
    need: int
    limit: int
    reason: str = ""
    retry_after_s: int | None = None

    @property
    def admitted(self) -> bool:
        return self.status == 200


class AdmissionRefused(RuntimeError):
    """Raised on the host's request path; the adapter turns it into the HTTP answer."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.reason)
        self.verdict = verdict


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass
class Ledger:
    """Reservations of the requests in flight, against one limit (thread-safe)."""

    limit: int
    reserved: dict[Hashable, int] = field(default_factory=dict)
    base: int | None = None  # MLX memory that is neither a stored entry nor a request
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe_idle(self, active: int, stored: int) -> None:
        """With nothing in flight, MLX's active memory minus the stored entries is the base.

        It only ever goes down: right after a request ends its cache may still be alive for a
        moment (the host drops it after answering), which must not be mistaken for the model.
        What requests really hold is checked against MLX's active memory at every admission.
        """
        with self._lock:
            if not self.reserved:
                seen = max(0, active - stored)
                self.base = seen if self.base is None else min(self.base, seen)

    def judge(self, key: Hashable, need: int, *, stored: int, active: int,
              alone: int | None = None, retry_after_s: int = 1) -> tuple[Verdict, int]:
        """The verdict for ``need`` bytes (reserved under ``key`` when admitted), and how
        many stored bytes must go first (0: none).

        ``alone``: what the request needs when nothing else runs (no batch to be copied
        into); 413 is decided on it, so a request that fits alone is never told it never
        fits. ``active``: MLX's active memory now; where requests in flight use more than
        they reserved (an estimate is an estimate), it wins over the ledger.
        """
        with self._lock:
            base = self.base or 0
            held = sum(self.reserved.values())
            # with requests in flight, MLX's count of what they really use wins where it is
            # higher; with none, what is left is a finished request's memory on its way out
            in_use = max(base + held, active - stored) if held else base
            if alone is not None and not held:
                need = alone  # it runs alone: no batch to be copied into
            if base + (need if alone is None else alone) > self.limit:
                return Verdict(413, need, self.limit, (
                    f"kvplugin: this request needs an estimated {_mib(need)} of memory (its "
                    f"KV cache for prompt + max_tokens and one prefill chunk) on top of "
                    f"{_mib(base)} the model holds, more than the limit of "
                    f"{_mib(self.limit)} (--max-memory / KVPLUGIN_MAX_MEMORY); it can never "
                    f"be served: shorten the prompt or max_tokens")), 0
            if in_use + need > self.limit:
                return Verdict(503, need, self.limit, (
                    f"kvplugin: this request needs an estimated {_mib(need)} of memory; "
                    f"requests in flight hold {_mib(in_use - base)} of the limit of "
                    f"{_mib(self.limit)} (--max-memory / KVPLUGIN_MAX_MEMORY); retry when "
                    f"they finish"), retry_after_s), 0
            self.reserved[key] = need
            excess = in_use + need + stored - self.limit
            return Verdict(200, need, self.limit), max(0, excess)

    def force(self, key: Hashable, need: int) -> None:
        """Reserve ``need`` whatever the limit (a plugin admitted the request)."""
        with self._lock:
            self.reserved[key] = need

    def release(self, key: Hashable) -> bool:
        with self._lock:
            return self.reserved.pop(key, None) is not None

    @property
    def held(self) -> int:
        with self._lock:
            return sum(self.reserved.values())
