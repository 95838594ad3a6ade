"""The remote tier: entries shared by replicas through Redis (or Valkey, same protocol).

Why Redis and not a home-made server: teams already run it, it bounds its own memory
(``maxmemory`` + ``allkeys-lru``), and every kvplugin write carries a TTL. kvplugin talks to it
with the ``redis`` client from the registry.

What the tier promises, because Redis is never on the critical path of correctness:

* **Writes are off the request thread.** ``publish`` serializes the entry where its arrays
  live (MLX arrays belong to the thread that made them) and queues the bytes; a writer thread
  hashes and sends them. Queued bytes are bounded (``queue_bytes``): past it a write is
  dropped and counted.
* **A fetch waits at most ``fetch_timeout``**, lookup included: the round trips run on a small
  pool while the request thread waits with that deadline. A lookup is two round trips whatever
  the prompt's length (see :mod:`kvplugin.cache.tiers.remote_keys`).
* **Down, slow or full is a miss**, with one warning, counters, and reconnection with
  back-off (0.5 s doubling to 30 s, no attempt in between). A wrong password or database, a
  TLS certificate that does not verify or an option the client does not take is a start-up
  error naming the flag, since serving without the tier would ignore what was asked. The
  password is never shown (:func:`kvplugin.resources.masked_url`).
* **Nothing read is trusted**: digest, size bound, namespace and tokens are checked
  (:mod:`kvplugin.cache.tiers.remote_wire`), and the store validates the entry against the
  model before the host sees it; a value the model refuses is deleted (``discard``).
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvplugin.cache.store.index import to_key
from kvplugin.cache.layers import copy_floor, copy_prefix, entry_nbytes
from kvplugin.cache.tiers.serialize import Unsupported
from kvplugin.cache.tiers.refusals import Refusals
from kvplugin.cache.tiers.remote_keys import FAN_OUT, Choice, Namespace, choose
from kvplugin.cache.tiers.remote_wire import Corrupt, decode, encode, seal
from kvplugin.resources import masked_url

__all__ = ["RemoteTier"]

log = logging.getLogger("kvplugin.cache")

FLAG = "--kv-cache-remote / KVPLUGIN_KV_CACHE_REMOTE"
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 30.0
_RESEND_AFTER_S = 60.0
_REFUSAL_LOG_S = 60.0
_COUNTERS = ("hits", "misses", "errors", "timeouts", "corrupt", "stale", "invalid",
             "too_large", "refused", "dropped", "puts", "bytes_read", "bytes_written")


def _client(url: str, timeout_s: float, connect_s: float) -> Any:
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No client-side retries: the tier's own back-off decides when to try again, and a
    # retry would stretch a request's wait past its deadline.
    return Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=connect_s,
                          retry=Retry(NoBackoff(), 0), health_check_interval=0)


class RemoteTier:
    """A :class:`kvplugin.types.ColdTier` on Redis, written through by ``publish``."""

    def __init__(self, url: str, *, entry_format: str, timeout_ms: int = 50,
                 fetch_timeout_ms: int = 5000, ttl_s: int = 3600, block_tokens: int = 128,
                 max_value_bytes: int = 512_000_000, queue_bytes: int = 256_000_000) -> None:
        try:
            import redis  # noqa: F401
        except ImportError:
            from kvplugin.settings import SettingsError

            raise SettingsError(f"kvplugin: {FLAG} needs the redis client: "
                                "pip install 'kvplugin[redis]'") from None
        self.url = masked_url(url)
        self.entry_format = entry_format
        self.timeout_s = timeout_ms / 1000
        self.fetch_timeout_s = fetch_timeout_ms / 1000
        self.ttl_s = ttl_s
        self.block = block_tokens
        self.max_value_bytes = max_value_bytes
        self.queue_bytes = queue_bytes
        # Values: a large entry takes a while as a whole (the fetch deadline bounds that),
        # but a Redis that stops sending is given up after a short silence.
        self.stall_s = min(self.fetch_timeout_s, max(4 * self.timeout_s, 0.25))
        try:
            self._lookup = _client(url, self.timeout_s, self.timeout_s)
            self._values = _client(url, self.stall_s, self.timeout_s)
            self._writes = _client(url, self.fetch_timeout_s, self.timeout_s)  # nobody waits
        except (TypeError, ValueError) as e:  # an option value the client cannot parse
            from kvplugin.settings import SettingsError

            raise SettingsError(f"kvplugin: {FLAG}: the redis client refused the URL "
                                f"{self.url} ({e})") from None
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._refusals = Refusals(f"remote tier {self.url}")
        self._fetch_seconds = 0.0
        self._fetches = 0
        self._down_until = 0.0
        self._backoff = 0.0
        self._last_refusal_log = -_REFUSAL_LOG_S
        self._spaces: dict[str, Namespace] = {}
        self._published: OrderedDict[str, float] = OrderedDict()  # value key -> sent at
        self._served: OrderedDict[int, str] = OrderedDict()  # id(cache) -> value key
        self._pending = 0
        self._closed = False
        self._pool = cf.ThreadPoolExecutor(2, thread_name_prefix="kvplugin-remote-read")
        self._jobs: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvplugin-remote-write",
                                        daemon=True)
        self._writer.start()
        self._check_start()

    # ---------------------------------------------------------------- health

    def _check_start(self) -> None:
        """PING once: credentials, database, a TLS certificate that does not verify and
        options the client does not take are start-up errors; unreachable is not."""
        import ssl

        import redis

        try:
            self._lookup.ping()
            log.info("kvplugin: remote tier %s reachable", self.url)
        except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as e:
            self._refuse(f"Redis at {self.url} refused the credentials ({e})")
        except redis.ResponseError as e:  # e.g. "DB index is out of range", NOAUTH
            self._refuse(f"Redis at {self.url} refused the connection ({e})")
        except (redis.ConnectionError, redis.TimeoutError) as e:
            if isinstance(e.__context__, ssl.SSLCertVerificationError):
                self._refuse(f"the TLS certificate of Redis at {self.url} was not verified "
                             f"({e.__context__.verify_message}); name the CA that signed it "
                             "with ?ssl_ca_certs=/path/ca.pem in the URL")
            self._failed(e)
        except (redis.RedisError, TypeError, ValueError) as e:  # an option the client refuses
            self._refuse(f"the redis client refused the URL {self.url} "
                         f"({type(e).__name__}: {e})")

    def _refuse(self, why: str) -> None:
        from kvplugin.settings import SettingsError

        self.close()
        raise SettingsError(f"kvplugin: {FLAG}: {why}")

    def _available(self) -> bool:
        return not self._closed and time.monotonic() >= self._down_until

    def _ok(self) -> None:
        with self._lock:
            was_down = self._backoff > 0
            self._backoff = 0.0
            self._down_until = 0.0
            if was_down:  # a restarted Redis may have lost what was sent
                self._published.clear()
        if was_down:
            log.warning("kvplugin: remote tier %s reachable again", self.url)

    def _failed(self, e: BaseException, *, timeout: bool = False) -> None:
        """Count a failure; a connection problem starts (or lengthens) the back-off."""
        import redis

        down = timeout or isinstance(e, (redis.ConnectionError, redis.TimeoutError, OSError))
        now = time.monotonic()
        with self._lock:
            self.counters["timeouts" if timeout else "errors"] += 1
            first = down and self._backoff == 0
            # Redis up but refusing (full, a command error): said at most once a minute.
            loud = not down and now - self._last_refusal_log >= _REFUSAL_LOG_S
            if loud:
                self._last_refusal_log = now
            if down:
                self._backoff = min(_BACKOFF_MAX_S, max(_BACKOFF_FIRST_S, self._backoff * 2))
                self._down_until = time.monotonic() + self._backoff
        if first:
            log.warning("kvplugin: remote tier %s unavailable (%s: %s); serving locally, "
                        "retrying with back-off", self.url, type(e).__name__, e)
        elif loud:
            log.warning("kvplugin: remote tier %s: %s: %s (serving locally; said at most once "
                        "a minute)", self.url, type(e).__name__, e)

    # ---------------------------------------------------------------- writes

    def _space(self, model_key: str) -> Namespace:
        ns = self._spaces.get(model_key)
        if ns is None:
            ns = self._spaces[model_key] = Namespace(model_key, self.entry_format, self.block)
        return ns

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def publish(self, model_key: str, tokens: Sequence[int], cache: list) -> bool:
        """Queue ``cache`` (holding ``tokens``) for Redis; True if queued. Runs in the
        caller's thread only as long as serializing takes; never raises."""
        if self._closed or len(tokens) < self.block or not cache:
            return False
        if not self._available():
            self._count("dropped")
            return False
        ns = self._space(model_key)
        key = ns.entry_key(tokens)
        now = time.monotonic()
        with self._lock:
            # Sent (or read from here) a moment ago: e.g. an entry fetched from Redis and
            # stored back unchanged. Only for a while: Redis may evict or lose it.
            if now - self._published.get(key, -_RESEND_AFTER_S) < _RESEND_AFTER_S:
                return False
        size = entry_nbytes(cache)
        if size > self.max_value_bytes:
            self._count("too_large")
            return False
        with self._lock:
            if self._pending + size > self.queue_bytes:
                self.counters["dropped"] += 1
                return False
            self._pending += size
        buf = None
        try:
            buf, trimmable = encode(ns.name, tokens, cache)
            floor = copy_floor(cache) if trimmable else None
            members = ns.members(tokens, floor, buf.seek(0, io.SEEK_END))
        except Unsupported as e:
            self._count("refused")
            self._refusals.unsupported(e, "shares")
            self._count_pending(-size)
            return False
        except Exception:
            log.exception("kvplugin: remote tier could not serialize an entry")
            self._count("refused")
            self._refusals.count("serialize_failed")
            self._count_pending(-size)
            if buf is not None:
                buf.close()
            return False
        self._jobs.put(("set", key, members, buf, size))
        with self._lock:
            self._published[key] = now
            self._published.move_to_end(key)
            if len(self._published) > 1024:
                self._published.popitem(last=False)
        return True

    def _count_pending(self, n: int) -> None:
        with self._lock:
            self._pending += n

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, key, members, buf, size = job
            view = None
            try:
                if kind != "set":
                    self._tend(kind, key, members)
                    continue
                if not self._available():
                    self._count("dropped")
                    continue
                view = seal(buf)
                if len(view) > self.max_value_bytes:
                    self._count("too_large")
                    continue
                pipe = self._writes.pipeline(transaction=False)
                pipe.set(key, view, ex=self.ttl_s)
                now = time.time()  # shared by replicas: newest first in every pointer set
                for pointer, member in members:
                    pipe.zadd(pointer, {member: now})
                    pipe.zremrangebyrank(pointer, 0, -FAN_OUT - 1)  # the oldest go
                    pipe.expire(pointer, self.ttl_s)
                pipe.execute()
                with self._lock:
                    self.counters["puts"] += 1
                    self.counters["bytes_written"] += len(view)
                self._ok()
            except Exception as e:
                self._failed(e)
            finally:
                if view is not None:
                    view.release()  # before the buffer can be freed
                if buf is not None:
                    buf.close()
                if size:
                    self._count_pending(-size)

    def _tend(self, kind: str, key: str, listed: list[tuple[str, bytes]] | None) -> None:
        """On the writer: delete a value; forget its members (its value is gone); or touch
        what a hit used, so that an entry in use outlives its TTL and stays in its sets."""
        pipe = self._writes.pipeline(transaction=False)
        if kind == "delete":
            pipe.delete(key)
        for pointer, member in listed or ():
            if kind == "forget":
                pipe.zrem(pointer, member)
            else:
                pipe.zadd(pointer, {member: time.time()}, xx=True)
                pipe.expire(pointer, self.ttl_s)
        if kind == "touch":
            pipe.expire(key, self.ttl_s)
        pipe.execute()

    # ---------------------------------------------------------------- reads

    @property
    def ask_beyond(self) -> int:
        """The store asks this tier whenever a hot hit leaves a token uncovered, as the hot
        tier would serve a longer entry however few tokens it adds: a lookup reads only the
        pointer sets past the hot hit, and a value only when it gives more."""
        return 1

    def _read(self, ns: Namespace, key: tuple, have: int) -> tuple[Choice, bytes] | None:
        """On the pool: read the pointer sets of ``key`` in one pipelined round trip,
        choose locally, then GET the chosen value only.

        Only the sets at block ends past ``have - block`` can name an entry giving more than
        ``have`` tokens: an entry sharing more is listed where its shared part ends."""
        pointers = [(end, p) for end, p in ns.pointer_keys(key) if end + self.block > have]
        if not pointers:
            return None
        pipe = self._lookup.pipeline(transaction=False)
        for _, pointer in pointers:
            pipe.zrevrange(pointer, 0, FAN_OUT - 1)  # newest first
        listed = [(end, pointer, members)
                  for (end, pointer), members in zip(pointers, pipe.execute()) if members]
        choice, too_large = choose(key, listed, self.block, have=have,
                                   max_bytes=self.max_value_bytes)
        if too_large:  # a better one was over the bound: never downloaded
            self._count("too_large")
        if choice is None:
            return None
        name = ns.value_key(choice.candidate.digest)
        raw = self._values.get(name)
        if raw is None:  # the value expired or was evicted before its members
            self._count("stale")
            self._jobs.put(("forget", name, choice.listed, None, 0))
            return None
        return choice, raw

    def fetch(self, model_key: str, tokens: Sequence[int], *,
              have: int = 0) -> tuple[list, int] | None:
        """The most leading tokens of ``tokens`` a stored entry gives, if more than ``have``:
        ``(cache, n)`` or None; never raises, never waits past ``fetch_timeout``."""
        key = to_key(tokens)
        if self._closed or len(key) < self.block:
            return None
        if not self._available():
            self._count("misses")
            return None
        ns = self._space(model_key)
        started = time.monotonic()
        try:
            found = self._pool.submit(self._read, ns, key, have).result(
                timeout=self.fetch_timeout_s)
        except cf.TimeoutError as e:
            self._failed(e, timeout=True)
            found = None
        except Exception as e:
            self._failed(e)
            found = None
        else:
            self._ok()
        got = self._use(ns, key, found, have) if found is not None else None
        with self._lock:
            self._fetches += 1
            self._fetch_seconds += time.monotonic() - started
            self.counters["hits" if got is not None else "misses"] += 1
        return got

    def _use(self, ns: Namespace, key: tuple, found: tuple[Choice, bytes],
             have: int) -> tuple[list, int] | None:
        choice, raw = found
        name = ns.value_key(choice.candidate.digest)
        self._count("bytes_read", len(raw))
        try:
            held, cache, trimmable = decode(raw, ns.name, self.max_value_bytes)
            if name != ns.entry_key(held):
                raise Corrupt("value stored under another entry's key")
        except Corrupt as e:
            log.warning("kvplugin: remote tier value %s is not used: %s", name, e)
            self._count("corrupt")
            self._jobs.put(("delete", name, None, None, 0))
            return None
        del raw
        common = 0
        for a, b in zip(held, key):
            if a != b:
                break
            common += 1
        n = common if common == len(held) else min(common, choice.n)
        if n <= have:
            return None
        if n < len(held):
            if not trimmable:
                return None
            cache = copy_prefix(cache, n)
            if cache is None:
                return None
        self._jobs.put(("touch", name, choice.listed, None, 0))
        with self._lock:
            self._served[id(cache)] = name
            if len(self._served) > 16:
                self._served.popitem(last=False)
            self._published[name] = time.monotonic()  # coming back unchanged
        return cache, n

    def discard(self, cache: list) -> None:
        """The store refused ``cache`` (it does not fit the model): delete its value."""
        with self._lock:
            name = self._served.pop(id(cache), None)
            if name is not None:
                self.counters["invalid"] += 1
        if name is not None:
            self._jobs.put(("delete", name, None, None, 0))

    # ---------------------------------------------------------------- the rest

    def put(self, model_key: str, tokens: Sequence[int], cache: list) -> bool:
        """Spills are not sent: every entry was published when it was stored."""
        return False

    def stats(self) -> dict:
        with self._lock:
            out = {f"remote_{k}": v for k, v in self.counters.items()}
            out["remote_fetches"] = self._fetches
            out["remote_fetch_seconds"] = round(self._fetch_seconds, 6)
            out["remote_connected"] = int(self._backoff == 0 and not self._closed)
            out["remote_queued_bytes"] = self._pending
        out["remote_refused_by_reason"] = self._refusals.by_reason()
        out["remote_url"] = self.url
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to ``timeout_s``), then disconnect."""
        if self._closed:
            return
        self._jobs.put(None)
        self._writer.join(timeout_s)
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in (self._lookup, self._values, self._writes):
            try:
                client.close()
            except Exception:
                pass

