"""Codec work on an entry's layers, two layers at a time on MLX's CPU.

Why: quantizing or dequantizing an entry is a few elementwise passes over every layer, and
MLX's CPU backend runs each stream's operations on one thread. The request waits for this
work (a hit is dequantized before its prefill), so on the CPU kvplugin gives each of two
layers its own stream and evaluates them together (docs/benchmarks.md). A dequantize on the
CPU runs in numpy where it can (kvplugin.cache.codec.cpu_dequantize); quantizing and 3-, 5- and
6-bit dequantizes come here. On a GPU one kernel already fills the device: one lane, the
default stream.

The transient stays bounded: a lane's layer is evaluated (and, with ``consume``, replaces
the original) before the next pair is made, so at most two layers are in flight.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from typing import Any, TypeVar

import mlx.core as mx

__all__ = ["in_lanes", "lane_count", "open_lanes"]

T = TypeVar("T")
R = TypeVar("R")

_local = threading.local()  # a stream belongs to the thread that made it


def lane_count() -> int:
    """Layers worked on at once: 2 on a CPU default device with 2 cores or more, else 1."""
    if mx.default_device() != mx.cpu or (os.cpu_count() or 1) < 2:
        return 1
    return 2


def _streams(count: int) -> list[Any]:
    streams = getattr(_local, "streams", None)
    if streams is None or len(streams) != count:
        streams = _local.streams = [mx.new_stream(mx.cpu) for _ in range(count)]
    return streams


def open_lanes() -> None:
    """Make this thread's lanes now, and start them.

    Why: each lane is an MLX CPU stream, and a stream starts its own worker thread on first
    use. Made lazily, that happens inside a server's first hit, where it reads as reuse
    costing more memory than stock's. A host whose model loads in the thread that then serves calls it there
    (``KVService.learn_model(..., serving_thread=True)``: mlx-lm), like loading the model.
    Elsewhere (vllm-mlx serves from an executor thread) lanes made early would go unused."""
    count = lane_count()
    if count < 2:
        return
    started = []
    for lane in _streams(count):
        with mx.stream(lane):
            started.append(mx.zeros((1,)) + 1)
    mx.eval(started)


def in_lanes(items: Iterable[T], work: Callable[[T], R],
             arrays: Callable[[R], list]) -> Iterator[R]:
    """``work(item)`` for every item, in order, each result's ``arrays(result)`` evaluated
    before it is yielded; with two lanes, two items' work runs at once."""
    count = lane_count()
    streams = _streams(count) if count > 1 else [None]
    pending: list[R] = []
    for item in items:  # an iterator, not a list: a consumed item must be free to go
        lane = streams[len(pending)]
        with mx.stream(lane) if lane is not None else nullcontext():
            pending.append(work(item))
        del item
        if len(pending) == count:
            mx.eval([a for r in pending for a in arrays(r)])
            yield from pending
            pending = []
    if pending:
        mx.eval([a for r in pending for a in arrays(r)])
        yield from pending
