"""Bounded KV caches that hold no more than they use: a rotating cache grown in large
staggered steps up to its bound, and stepped KVCaches.

Why: mlx-lm's ``KVCache`` and ``RotatingKVCache`` grow by concatenating 256 zero slots, so every
growth step holds the old and the new buffer at once (a 2x transient), and a multi-token
prefill makes ``RotatingKVCache`` keep up to ``max_size + L - 1`` slots.
:class:`PreallocatedRotatingKVCache` grows each layer by
large steps staggered across layers until ``max_size`` slots, writes in place afterwards, and
after every update keeps at most ``max_size`` slots, while returning to attention exactly the
keys/values (same tokens, same order) that the stock class returns, so attention outputs are
bitwise identical.

Memory: filling to the bound by one-token steps holds the tokens plus one growth step per layer
and copies one layer's buffer at a time (stock: every layer on the same step). A chunk
that still fits is written in place (no transient). A chunk of ``L`` tokens that wraps needs its
attention window, ``max_size - 1 + L`` fresh slots, for as long as attention runs; we evaluate
that window before writing the buffer so MLX can donate the buffer to the in-place write, so
the peak is buffer + window and afterwards only the buffer stays. Stock builds the same window
(plus a temporal-order copy when rotated) and then keeps it as its buffer.

Saving/loading: ``mlx_lm.models.cache.load_prompt_cache`` resolves class names with
``globals()[name]`` in its own module, so the host adapters register the subclass there
through their patch registry (:func:`register_with_mlx_lm`, idempotent, undone on uninstall). We keep the true class name rather than saving as
``RotatingKVCache`` because a stock ``RotatingKVCache`` loaded from our state would work but
silently lose pre-allocation; the cost is that a process loading such a file must import this
module and register it first (every host process kvplugin patches does). The saved state has the stock layout (an
exact-size prefix while ``offset < max_size``), so it is small and a stock class could read it.

Imports only ``mlx.core`` and ``mlx_lm.models.cache``; works on mlx-lm 0.31.3 (``state`` +
``meta_state``) and 0.32.x (``state`` only).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as _mlx_cache
from mlx_lm.models.cache import BatchRotatingKVCache, KVCache, RotatingKVCache

from kvplugin.cache.bounded.keep_batch import KeepingBatchRotatingKVCache
from kvplugin.cache.bounded.reach import STEPPED, unbounded_kinds

__all__ = [
    "PreallocatedRotatingKVCache",
    "register_with_mlx_lm",
    "make_stepped_kv_cache",
    "apply_growth_step",
    "bound_cache",
    "rewind_decode",
]


def _eval_now(*arrays: mx.array) -> None:
    """Evaluate ``arrays`` unless we are inside a function transformation (compile, vmap...).

    Evaluating the attention window before writing the buffer lets MLX donate the buffer to the
    in-place write (without it the write copies the whole buffer).
    Under a transformation ``eval`` raises ``ValueError``; the lazy path is equally correct,
    only less frugal.
    """
    try:
        mx.eval(*arrays)
    except ValueError:  # pragma: no cover - only inside mx.compile / mx.vmap
        pass


#: Slots a bounded cache grows by at least, and the granularity of its growth.
GROW_UNIT = 256


class PreallocatedRotatingKVCache(RotatingKVCache):
    """``RotatingKVCache(max_size, keep)`` that grows in large steps, then never again.

    Why not allocate ``max_size`` slots up front: a 32k bound then holds the whole bound from
    the first token (540 MiB at 1k tokens of context on a KV-heavy model where stock growth
    holds 44 MiB). Why not grow like stock (256 slots at a time, every layer on the same
    step): every layer copies its whole buffer on the same decode step, so that step is
    many times slower than the rest, and a multi-token chunk keeps up to ``max_size + L - 1``
    slots. So each layer grows by ``max(256, its capacity / layers)`` slots, with its growth
    points staggered by its index (``index``, ``layers``): at most about one layer copies its
    buffer on any decode step, what a layer holds beyond its tokens is one growth step, and
    the copy in flight is one layer's buffer. At ``max_size`` slots it stops growing and
    rotates in place.

    Layout invariant (the one the stock class reaches after a one-token update, which is why
    ``make_mask``, ``_temporal_order``, ``trim``, ``size`` and batch ``merge`` work unchanged):
    while ``offset < max_size`` slots ``[0, offset)`` hold the tokens in order and
    ``_idx == offset`` (the buffer may hold more slots); once full, the buffer is ``max_size``
    slots, ``[0, keep)`` hold the first ``keep`` tokens and ``[keep, max_size)`` a ring whose
    next write position is ``_idx`` (``max_size`` = wrap next).

    After a multi-token chunk of ``L`` tokens the stock class keeps the chunk's whole attention
    window (up to ``max_size + L - 1`` slots); its next update would cut that down to ``keep`` +
    the newest ``max_size - keep`` tokens in temporal order, so we store exactly that right away
    with ``_idx = max_size``: later results are the same, the memory is not.
    """

    # class defaults: instances made without __init__ (mlx-lm's from_state, copies) grow
    # unstaggered, one layer's worth at a time
    _layers = 1
    _phase = 0

    def __init__(self, max_size: int, keep: int = 0, *, index: int = 0, layers: int = 1):
        if max_size < 1 or not 0 <= keep < max_size:
            raise ValueError(f"need max_size >= 1 and 0 <= keep < max_size, got {max_size}, {keep}")
        super().__init__(max_size, keep)
        self._layers = max(1, int(layers))
        self._phase = (int(index) * GROW_UNIT // self._layers) % GROW_UNIT
        self._reset_undo()

    #: The undo log: the live request's, never a copy's or a stored entry's (see
    #: ``layers.extra_scalars``). An entry is stored at its key (:func:`rewind_decode`), so
    #: at rest there is nothing to take back; a copy or a restored layer starts a log of its own.
    TRANSIENT_ATTRS = ("_undo_idx", "_undo_over", "_undo_blocks")

    #: Slots copied at a time into the undo log (one copy and one evaluation per block, so
    #: every other one-token write still donates the buffer in place).
    UNDO_BLOCK = 256

    # -- undo log: exact trim after the ring has wrapped -------------------------------
    # Why: the sequential path stores prompt + answer; once the ring has wrapped the stock
    # class cannot trim, so the next turn (which shares only the prompt and part of the answer)
    # reused nothing. One-token writes since the last multi-token chunk are logged: the
    # ``_idx`` before each write, and a copy of each ring block taken before its first write
    # since then. ``trim(n)`` for n <= the logged writes restores the overwritten slots, so the
    # state is bitwise the one a cache that never saw those tokens has. The log holds at most
    # one ring's worth of writes (each slot written once); beyond that it is dropped.
    def _reset_undo(self) -> None:
        self._undo_idx: list[int] | None = []  # _idx before each logged write
        self._undo_over: list[bool] = []  # whether that write overwrote a token
        self._undo_blocks: dict[int, tuple[mx.array, mx.array]] = {}

    def drop_undo(self) -> None:
        """Forget the undo log (a stored entry keeps exactly its ``max_size`` slots)."""
        self._reset_undo()

    def undo_len(self) -> int:
        """One-token writes that :meth:`trim` can take back (0: none, or the log was dropped)."""
        log_ = getattr(self, "_undo_idx", None)
        return 0 if log_ is None else len(log_)

    def undo_nbytes(self) -> int:
        """Bytes the undo log's block copies hold (only blocks overwritten since a chunk)."""
        return sum(k.nbytes + v.nbytes for k, v in getattr(self, "_undo_blocks", {}).values())

    def _log_write(self, idx: int) -> None:
        if not hasattr(self, "_undo_idx"):  # made by copy_prefix / __new__
            self._reset_undo()
        if self._undo_idx is None:
            return
        over = self.offset >= self.max_size  # a write below the offset overwrites nothing
        if over and sum(self._undo_over) >= self.max_size - self.keep:
            self._undo_idx, self._undo_over, self._undo_blocks = None, [], {}  # slot twice
            return
        self._undo_idx.append(self._idx)
        self._undo_over.append(over)
        b = idx // self.UNDO_BLOCK
        if over and b not in self._undo_blocks:
            lo, hi = b * self.UNDO_BLOCK, min((b + 1) * self.UNDO_BLOCK, self.max_size)
            k = mx.contiguous(self.keys[..., lo:hi, :])
            v = mx.contiguous(self.values[..., lo:hi, :])
            _eval_now(k, v)  # copied before the write, so the write can still donate
            self._undo_blocks[b] = (k, v)

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size or self.undo_len() > 0

    def trim(self, n: int) -> int:
        if self.offset < self.max_size:  # never wrapped: nothing was overwritten
            n = super().trim(n)
            if self.undo_len():
                cut = max(0, len(self._undo_idx) - n)
                del self._undo_idx[cut:], self._undo_over[cut:]
            return n
        n = min(n, self.undo_len())
        if n <= 0:
            return 0
        cut = len(self._undo_idx) - n
        for pre, over in zip(reversed(self._undo_idx[cut:]), reversed(self._undo_over[cut:])):
            if over:
                slot = self.keep if pre >= self.max_size else pre
                b = slot // self.UNDO_BLOCK
                k, v = self._undo_blocks[b]
                j = slot - b * self.UNDO_BLOCK
                self.keys[..., slot : slot + 1, :] = k[..., j : j + 1, :]
                self.values[..., slot : slot + 1, :] = v[..., j : j + 1, :]
            self._idx = pre
        del self._undo_idx[cut:], self._undo_over[cut:]
        self.offset -= n
        if not any(self._undo_over):
            self._undo_blocks = {}
        return n

    # -- buffer management -------------------------------------------------------------
    def _capacity_for(self, need: int) -> int:
        """Slots for ``need`` tokens: rounded up to this layer's staggered growth points."""
        cap = -(-(need + self._phase) // GROW_UNIT) * GROW_UNIT - self._phase
        return min(self.max_size, cap if cap >= need else cap + GROW_UNIT)

    def _allocate(self, keys: mx.array, values: mx.array, dtype: Any = None,
                  slots: int | None = None) -> None:
        B, H, _, Dk = keys.shape
        Dv = values.shape[3]
        n = self.max_size if slots is None else slots
        self.keys = mx.zeros((B, H, n, Dk), dtype or keys.dtype)
        self.values = mx.zeros((B, H, n, Dv), dtype or values.dtype)

    def _grow(self, need: int) -> None:
        """At least ``need`` slots (while not full): one growth step, or more if asked."""
        cur = self.keys.shape[2]
        if need <= cur:
            return
        step = max(GROW_UNIT, -(-(cur // self._layers) // GROW_UNIT) * GROW_UNIT)
        new = min(self.max_size, max(self._capacity_for(need), self._capacity_for(cur + step)))
        n = min(self.offset, cur)
        B, H, _, Dk = self.keys.shape
        Dv = self.values.shape[3]
        pad_k = mx.zeros((B, H, new - n, Dk), self.keys.dtype)
        pad_v = mx.zeros((B, H, new - n, Dv), self.values.dtype)
        self.keys = mx.concatenate([self.keys[..., :n, :], pad_k], axis=2)
        self.values = mx.concatenate([self.values[..., :n, :], pad_v], axis=2)

    def _ensure_buffer(self, keys: mx.array, values: mx.array) -> None:
        """Have a buffer: allocate on first use; adopt a loaded/stock-layout state."""
        if self.keys is None:
            self._allocate(keys, values, slots=self._capacity_for(keys.shape[2]))
            self._idx = 0
            return
        cap = self.keys.shape[2]
        if cap == self.max_size if self.offset >= self.max_size else (
                self._idx == self.offset and self.offset <= cap):
            return  # our layout (a trimmed or loaded prefix too: it grows from there)
        # State set from elsewhere (a trimmed/loaded entry, a stock cache's state): move it once
        # into a buffer of our own, in temporal order, as the stock class's next update would.
        old_k = self._temporal_order(self.keys)
        old_v = self._temporal_order(self.values)
        n = old_k.shape[2]
        if n > self.max_size:
            tail = n - (self.max_size - self.keep)
            old_k = mx.concatenate([old_k[..., : self.keep, :], old_k[..., tail:, :]], axis=2)
            old_v = mx.concatenate([old_v[..., : self.keep, :], old_v[..., tail:, :]], axis=2)
            n = self.max_size
        slots = self.max_size if self.offset >= self.max_size else self._capacity_for(n + 1)
        self._allocate(old_k, old_v, old_k.dtype, slots=slots)
        self.keys[..., :n, :] = old_k
        self.values[..., :n, :] = old_v
        self._idx = n

    def _window(self, v: mx.array) -> list[mx.array]:
        """The stored window in temporal order, cut to ``max_size - 1`` tokens, as views.

        That is what the stock class puts before a chunk: every new token then sees at least
        ``max_size`` tokens (itself included) and the mask trims the rest.
        """
        if self.offset < self.max_size:
            return [v[..., : self.offset, :]]
        keep, idx = self.keep, self._idx
        if idx >= self.max_size:  # ring in order; drop its oldest slot (keep)
            pieces = [v[..., :keep, :], v[..., keep + 1 :, :]]
        else:  # oldest at idx
            pieces = [v[..., :keep, :], v[..., idx + 1 :, :], v[..., keep:idx, :]]
        return [p for p in pieces if p.shape[2] > 0]

    def _store_last(self, k_all: mx.array, v_all: mx.array) -> None:
        """Keep ``keep`` + the newest ``max_size - keep`` tokens of a temporal-order window."""
        total = k_all.shape[2]
        tail = total - (self.max_size - self.keep)
        if self.keys.shape[2] < self.max_size:  # full from now on: the ring's own buffer
            self._allocate(k_all, v_all, slots=self.max_size)
        if self.keep:
            self.keys[..., : self.keep, :] = k_all[..., : self.keep, :]
            self.values[..., : self.keep, :] = v_all[..., : self.keep, :]
        self.keys[..., self.keep :, :] = k_all[..., tail:, :]
        self.values[..., self.keep :, :] = v_all[..., tail:, :]
        self._idx = self.max_size

    # -- updates -----------------------------------------------------------------------
    def _update_concat(self, keys: mx.array, values: mx.array):
        S = keys.shape[2]
        first = self.keys is None
        self._reset_undo()  # a chunk is not logged: trimming stops here
        self._ensure_buffer(keys, values)
        if first:
            # Stock returns the chunk itself; we do too and store what will stay visible.
            if S <= self.max_size:
                self.keys[..., :S, :] = keys
                self.values[..., :S, :] = values
                self._idx = S
            else:
                self._store_last(keys, values)
            self.offset += S
            return keys, values
        n = min(self.offset, self.max_size)
        if self.offset < self.max_size and n + S <= self.max_size:
            # Fits without wrapping: write in place, return views (stock: concat, same data).
            self._grow(n + S)
            self.keys[..., n : n + S, :] = keys
            self.values[..., n : n + S, :] = values
            self.offset += S
            self._idx = n + S
            return self.keys[..., : n + S, :], self.values[..., : n + S, :]
        # Wraps: the attention window must exceed max_size for this chunk; build it fresh,
        # then keep only its last max_size-worth in the buffer.
        k_all = mx.concatenate(self._window(self.keys) + [keys], axis=2)
        v_all = mx.concatenate(self._window(self.values) + [values], axis=2)
        _eval_now(k_all, v_all)
        self._store_last(k_all, v_all)
        self.offset += S
        return k_all, v_all

    def _update_in_place(self, keys: mx.array, values: mx.array):
        S = keys.shape[2]
        self._ensure_buffer(keys, values)
        idx = self.keep if self._idx >= self.max_size else self._idx
        if idx + S > self.max_size:  # only reachable for S > 1, which stock sends to concat
            return self._update_concat(keys, values)
        if self.offset < self.max_size:
            self._grow(idx + S)
        if S == 1:
            self._log_write(idx)
        else:
            self._reset_undo()
        self._idx = idx
        self.keys[..., idx : idx + S, :] = keys
        self.values[..., idx : idx + S, :] = values
        self.offset += S
        self._idx += S
        if self.offset < self.max_size:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    @classmethod
    def merge(cls, caches: list) -> Any:
        """Batch these rows (mlx-lm's batched path). Rows that keep first tokens go to a batch
        cache that keeps them too, so a request answers the same batched or not."""
        if caches[0].keep > 0:
            return KeepingBatchRotatingKVCache.merge(caches)
        return BatchRotatingKVCache.merge(caches)

    # -- state: stock layout, exact-size while not full (small files, no zero slots saved) --
    def _get_state(self):
        state = RotatingKVCache.state.fget(self)
        if self.keys is not None and self.offset < self.keys.shape[2]:
            n = self.offset
            state = (self.keys[..., :n, :], self.values[..., :n, :], *tuple(state)[2:])
        return state

    state = property(_get_state, RotatingKVCache.state.fset)


def register_with_mlx_lm(patches: Any = None) -> None:
    """Make ``mlx_lm.models.cache.load_prompt_cache`` (and ``CacheList``) find our class.

    Both resolve saved class names through that module's ``globals()``. Adds a name and
    replaces nothing of mlx-lm's; idempotent. Host adapters pass their patch registry
    (anything with ``add(owner, name, value)``) so that uninstalling takes the name away
    again; a script that only wants to load such files may call it without one. Importing
    this module changes nothing in mlx-lm.
    """
    name = PreallocatedRotatingKVCache.__name__
    if getattr(_mlx_cache, name, None) is PreallocatedRotatingKVCache:
        return
    if patches is None:
        setattr(_mlx_cache, name, PreallocatedRotatingKVCache)
    else:
        patches.add(_mlx_cache, name, PreallocatedRotatingKVCache)


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"growth step must be a positive integer, got {step!r}")
    return step


def make_stepped_kv_cache(step: int) -> KVCache:
    """An unbounded ``KVCache`` growing ``step`` slots at a time (instance attribute ``step``).

    ``KVCache.update_and_fetch`` reads ``self.step``, so the instance attribute makes the first
    update allocate ``ceil(S/step)*step`` slots: a large step pre-allocates the expected context
    in one go and avoids the 2x concatenation transient of every 256-slot growth.
    """
    cache = KVCache()
    cache.step = _check_step(step)
    return cache


def apply_growth_step(cache: list, step: int) -> list:
    """Set the growth ``step`` on every plain ``KVCache``/``QuantizedKVCache`` layer, in place.

    Returns the same list (built fresh by ``make_prompt_cache``, so mutating is safe). Other
    layer kinds do not grow by ``step`` in a way we control and are left alone.
    """
    step = _check_step(step)
    for layer in cache:
        if type(layer) in STEPPED:
            layer.step = step
    return cache


def bound_cache(cache: list, max_kv_size: int, keep: int = 4) -> tuple[list, int]:
    """Bound a fresh per-request cache to ``max_kv_size`` tokens per layer.

    - empty plain ``KVCache`` -> ``PreallocatedRotatingKVCache(max_kv_size, keep)`` (what
      mlx-lm's own ``--max-kv-size`` builds, ``RotatingKVCache(max_kv_size, keep=4)``, minus the
      growth spikes);
    - empty stock ``RotatingKVCache`` (a model's sliding-window layer) ->
      ``PreallocatedRotatingKVCache(min(its max_size, max_kv_size), its keep)``: a window smaller
      than the bound is the model's own and stays exactly as it was; a larger one is bounded
      like the full-attention layers;
    - ``PreallocatedRotatingKVCache`` and ``ArraysCache`` (fixed-size recurrent state): kept;
    - anything else (non-empty layers, ``QuantizedKVCache``, ``ChunkedKVCache``, ``CacheList``
      whose model code may rely on its children's exact classes, unknown kinds): kept and
      counted.

    Returns ``(new_list, n_unbounded)`` where ``n_unbounded`` counts layers whose memory can
    still grow beyond ``max_kv_size`` tokens (:func:`~kvplugin.cache.bounded.reach.unbounded_kinds`).
    """
    if isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int) or max_kv_size < 1:
        raise ValueError(f"max_kv_size must be a positive integer, got {max_kv_size!r}")
    if not 0 <= keep < max_kv_size:
        raise ValueError(f"keep must be in [0, max_kv_size), got {keep!r}")
    out: list = []
    n = len(cache)
    for i, layer in enumerate(cache):
        t = type(layer)
        if t is KVCache and layer.keys is None:
            out.append(PreallocatedRotatingKVCache(max_kv_size, keep, index=i, layers=n))
        elif t is RotatingKVCache and layer.keys is None:
            size = min(layer.max_size, max_kv_size)
            out.append(PreallocatedRotatingKVCache(size, min(layer.keep, size - 1), index=i,
                                                   layers=n))
        else:
            out.append(layer)
    return out, sum(unbounded_kinds(out, max_kv_size).values())


def rewind_decode(cache: list) -> int:
    """Take back the one-token writes of a wrapped bounded entry before it is stored.

    Why: once a ``PreallocatedRotatingKVCache`` has wrapped, only its logged one-token writes
    can be trimmed. The sequential path stores prompt + answer, and the next turn shares only
    the prompt and part of the (re-tokenized) answer, so such an entry would be reused for
    nothing. Rewound to the end of its last prefill chunk it is the entry the batched path
    stores (the prompt boundary), which the next turn extends. Every layer goes back by the
    same number of tokens, or none does. The logs are dropped either way, so a stored entry
    holds its ``max_size`` slots and nothing more. Returns the tokens taken back.
    """
    bounded = [c for c in cache if isinstance(c, PreallocatedRotatingKVCache)]
    wrapped = [c for c in bounded if c.offset >= c.max_size]
    r = min((c.undo_len() for c in wrapped), default=0)
    if r and all(getattr(c, "is_trimmable", lambda: False)() for c in cache):
        for c in cache:
            c.trim(r)
    else:
        r = 0
    for c in bounded:
        c.drop_undo()
    return r
