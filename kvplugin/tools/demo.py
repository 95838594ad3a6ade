"""``kvplugin demo``: kvplugin at work in a real host server, offline, in about a minute.

Builds the tiny local model once (:func:`kvplugin.tools.models.tiny.build_tiny_model`, reused from
:func:`~kvplugin.tools.models.tiny.default_model_dir`), starts an installed host (``mlx_lm.server``
by default, ``vllm-mlx serve`` with ``--host vllm-mlx``) on 127.0.0.1 with kvplugin's
options, holds a short multi-turn conversation behind a long system prompt, stops the
server and prints what kvplugin did (``GET /kvplugin/stats``): entries stored, bytes at
fp16 vs as stored, cache hits, and time to first token cold vs warm, measured two ways.

The server runs in its own process group (:class:`kvplugin.tools.hostproc.ServerProcess`) and is
stopped on every way out: normal end, error, Ctrl-C (exit 130) and SIGTERM (exit 143).

This module also holds the client side shared with ``kvplugin bench --server``
(:mod:`kvplugin.tools.bench.server`): host launch specs, streamed/timed chat requests, prompt
text of a given token length, and the stderr status line. Stdlib only at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from kvplugin.tools import hostproc
from kvplugin.tools.hostproc import HostNotInstalled, ServerProcess, ServerStartError

__all__ = [
    "HOSTS",
    "HostSpec",
    "host_spec",
    "Reply",
    "stream_chat",
    "timed_chat",
    "TextMaker",
    "Status",
    "prepare_model",
    "DemoFailed",
    "build_parser",
    "main",
]

HOSTS = ("mlx-lm", "vllm-mlx")
STATS_PATH = "/kvplugin/stats"
KiB = 1 << 10
MiB = 1 << 20


class DemoFailed(RuntimeError):
    """The demo cannot show kvplugin working; the message says why (exit code 1)."""


# =============================================================================================
# hosts


@dataclass(frozen=True)
class HostSpec:
    """How to launch one host on the tiny model and talk to it."""

    name: str  # "mlx-lm" / "vllm-mlx"
    distribution: str
    script: str  # console script next to sys.executable
    model: str | None  # the request's "model" (None: the server's default model)
    env: Mapping[str, str] = field(default_factory=dict)

    def version(self) -> str:
        """Installed version; :class:`HostNotInstalled` with an install hint if missing."""
        try:
            return hostproc.host_version(self.distribution)
        except HostNotInstalled:
            raise HostNotInstalled(
                f"{self.name} is not installed in this environment ({sys.executable}). "
                f"Install it with: {INSTALL_HINT[self.name]}"
            ) from None

    def check(self) -> str:
        """Version of an installed host that kvplugin supports; raises otherwise."""
        version = self.version()
        from packaging.version import InvalidVersion, Version

        from kvplugin.hosts import get_adapter

        supported = get_adapter(self.name).supported
        try:
            ok = Version(version) in supported
        except InvalidVersion:
            ok = False
        if not ok:
            raise DemoFailed(
                f"{self.name} {version} is installed, but kvplugin supports {self.name} "
                f"{supported} only: the server would run stock. Install a supported version, "
                f"e.g. {INSTALL_HINT[self.name]}"
            )
        return version

    def command(self, model_dir: Path | str, port: int, extra: Sequence[str] = ()) -> list[str]:
        script = Path(sys.executable).parent / self.script
        if self.name == "vllm-mlx":
            if not script.is_file():
                raise HostNotInstalled(
                    f"the vllm-mlx command is not next to {sys.executable}; install vllm-mlx "
                    f"into this environment: {INSTALL_HINT['vllm-mlx']}")
            return hostproc.vllm_mlx_serve_cmd(model_dir, port, *extra)
        if script.is_file():
            return hostproc.mlx_lm_server_cmd(model_dir, port, *extra)
        return hostproc.mlx_lm_module_cmd(model_dir, port, *extra)  # python -m mlx_lm server

    def budget_args(self, nbytes: int) -> list[str]:
        """Host flags for a prompt-cache byte budget (and no small entry-count limit)."""
        if self.name == "vllm-mlx":
            return ["--cache-memory-mb", str(max(1, round(nbytes / 1e6)))]
        return ["--prompt-cache-bytes", str(int(nbytes)), "--prompt-cache-size", "1000"]

    @property
    def label(self) -> str:
        return "mlx_lm.server" if self.name == "mlx-lm" else "vllm-mlx serve"


INSTALL_HINT = {
    "mlx-lm": 'pip install "kvplugin[mlx-lm]"',
    "vllm-mlx": 'pip install "kvplugin[vllm-mlx]" && pip install --no-deps "vllm-mlx==0.6.0"',
}

_SPECS = {
    "mlx-lm": HostSpec("mlx-lm", "mlx-lm", "mlx_lm.server", None),
    # simple mode answers 503 to a request that arrives while another runs, unless told to wait
    "vllm-mlx": HostSpec("vllm-mlx", "vllm-mlx", "vllm-mlx", hostproc.SERVED_MODEL_NAME,
                         {"VLLM_MLX_SIMPLE_ENGINE_LOCK_ADMISSION": "wait"}),
}


def host_spec(name: str) -> HostSpec:
    return _SPECS[name]


# =============================================================================================
# requests


@dataclass
class Reply:
    """One chat request as the client saw it (times in seconds from sending the request)."""

    text: str = ""
    ttft_s: float | None = None  # first streamed token (streaming) / whole request (1 token)
    total_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    streamed: bool = True

    @property
    def decode_tps(self) -> float | None:
        """Tokens per second between the first and the last streamed token."""
        n = self.completion_tokens or len(self.token_times)
        if not self.token_times or n < 2:
            return None
        span = self.token_times[-1] - self.token_times[0]
        return (n - 1) / span if span > 0 else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("token_times")
        out["decode_tps"] = self.decode_tps
        return out


def _body(srv: ServerProcess, messages: Sequence[Mapping[str, Any]], max_tokens: int,
          stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": list(messages), "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if srv.model is not None:
        body["model"] = srv.model
    return body


def _usage(reply: Reply, usage: Mapping[str, Any] | None) -> None:
    if not usage:
        return
    reply.prompt_tokens = usage.get("prompt_tokens", reply.prompt_tokens)
    reply.completion_tokens = usage.get("completion_tokens", reply.completion_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        reply.cached_tokens = int(details["cached_tokens"])


def stream_chat(srv: ServerProcess, messages: Sequence[Mapping[str, Any]], max_tokens: int = 16,
                timeout: float | None = None) -> Reply:
    """POST a streamed chat completion; time the first and every content chunk."""
    data = json.dumps(_body(srv, messages, max_tokens, True)).encode()
    req = urllib.request.Request(srv.url + "/v1/chat/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    reply = Reply()
    t0 = time.perf_counter()
    try:
        resp = urllib.request.urlopen(req, timeout=timeout or srv.request_timeout)
    except urllib.error.HTTPError as e:
        raise hostproc.ServerHTTPError("POST", req.full_url, e.code,
                                       e.read().decode(errors="replace")) from None
    with resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank lines and ": keepalive" comments during prefill
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            now = time.perf_counter() - t0
            chunk = json.loads(payload)
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                content = delta.get("content")
                if content is None:
                    content = choice.get("text")
                if content:
                    if reply.ttft_s is None:
                        reply.ttft_s = now
                    reply.token_times.append(now)
                    reply.text += content
            _usage(reply, chunk.get("usage"))
    reply.total_s = time.perf_counter() - t0
    return reply


def timed_chat(srv: ServerProcess, messages: Sequence[Mapping[str, Any]], max_tokens: int = 1,
               timeout: float | None = None) -> Reply:
    """A non-streamed chat completion, timed as a whole (``ttft_s`` = ``total_s``)."""
    t0 = time.perf_counter()
    out = srv.chat(list(messages), max_tokens=max_tokens, temperature=0.0, timeout=timeout)
    reply = Reply(streamed=False)
    reply.total_s = reply.ttft_s = time.perf_counter() - t0
    reply.text = hostproc.answer_text(out)
    _usage(reply, out.get("usage"))
    return reply


def get_stats(srv: ServerProcess) -> dict[str, Any] | None:
    """``GET /kvplugin/stats`` as a dict, or None when the route does not answer JSON."""
    try:
        status, body = srv.request("GET", STATS_PATH, timeout=30)
    except OSError:
        return None
    if status != 200 or not isinstance(body, dict) or body.get("active") is False:
        return None
    return body


# =============================================================================================
# prompt text


class TextMaker:
    """Readable text of (about) a given number of the tiny model's tokens.

    Sentences of the local corpus, shuffled by ``seed`` and prefixed with a tag, so that two
    seeds give prompts that differ from their first words (no accidental shared prefix).
    Token counts come from the model's own ``tokenizer.json`` (exact to a few tokens; the
    server's ``usage.prompt_tokens`` is what gets reported).
    """

    def __init__(self, model_dir: Path | str):
        from kvplugin.tools.models.corpus import CORPUS

        self._sentences = [s.strip() + "." for s in re.split(r"\.\s+", " ".join(CORPUS.split()))
                           if len(s.strip()) > 2]
        self._tok = None
        try:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        except Exception:  # no tokenizers: ~3.2 characters per token on this corpus
            self._tok = None

    def starts(self) -> list[str]:
        """Words that each begin a text with a different first token (as many as the
        vocabulary allows): prompts starting with different ones share no prefix at all."""
        if self._tok is None:
            words = sorted({w for s in self._sentences for w in re.findall(r"[A-Za-z]{3,}", s)})
            return words
        out, seen = [], set()
        for i in range(self._tok.get_vocab_size()):
            word = self._tok.decode([i])
            if len(word.strip()) < 2 or not word.strip().isalpha() or i in seen:
                continue
            if self._tok.encode(word + " 1.").ids[0] == i:
                seen.add(i)
                out.append(word)
        return out

    def first_token(self, text: str) -> int | str:
        if self._tok is None:
            return text.split(None, 1)[0] if text.strip() else ""
        ids = self._tok.encode(text).ids
        return ids[0] if ids else -1

    def count(self, text: str) -> int:
        if self._tok is None:
            return max(1, round(len(text) / 3.2))
        return len(self._tok.encode(text).ids)

    def text(self, n_tokens: int, seed: Any, tag: str | None = None) -> str:
        rng = random.Random(str(seed))
        order = list(self._sentences)
        rng.shuffle(order)
        head = f"{tag or 'Notes'} {rng.randrange(10**6):06d}."
        parts, i = [head], 0
        while self.count(" ".join(parts)) < n_tokens:
            parts.append(order[i % len(order)])
            i += 1
            if i % len(order) == 0:
                rng.shuffle(order)
        text = " ".join(parts)
        if self._tok is not None:
            ids = self._tok.encode(text).ids
            if len(ids) > n_tokens:
                text = self._tok.decode(ids[:n_tokens])
        return text


# =============================================================================================
# progress on stderr


class Status:
    """``with Status("starting the server"):`` -- a spinner with elapsed seconds on a
    terminal, or one line when it starts and one when it ends otherwise. stderr only."""

    FRAMES = "|/-\\"

    def __init__(self, message: str, *, enabled: bool = True, stream: Any = None):
        self.message = message
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self.note = ""

    def _write(self, text: str) -> None:
        with contextlib.suppress(Exception):
            self.stream.write(text)
            self.stream.flush()

    def _spin(self) -> None:
        i = 0
        while not self._stop.wait(0.1):
            elapsed = time.monotonic() - self._t0
            self._write(f"\r{self.FRAMES[i % 4]} {self.message} ({elapsed:.1f} s){self.note}\033[K")
            i += 1

    def __enter__(self) -> "Status":
        self._t0 = time.monotonic()
        if not self.enabled:
            return self
        if self.tty:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        else:
            self._write(f"kvplugin: {self.message} ...\n")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        elapsed = time.monotonic() - self._t0
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if not self.enabled:
            return
        if exc_type is None:
            verdict = "done"
        elif issubclass(exc_type, KeyboardInterrupt):
            verdict = "interrupted"
        else:
            verdict = "failed"
        if self.tty:
            mark = "+" if exc_type is None else "x"
            self._write(f"\r{mark} {self.message}: {verdict} ({elapsed:.1f} s){self.note}\033[K\n")
        else:
            self._write(f"kvplugin: {self.message}: {verdict} ({elapsed:.1f} s){self.note}\n")


def say(message: str) -> None:
    print(f"kvplugin: {message}", file=sys.stderr, flush=True)


def prepare_model(model_dir: Path | None, *, rebuild: bool = False, progress: bool = True) -> Path:
    """The tiny model's directory: reused when complete, else built (once) with a status line."""
    from kvplugin.tools.models.tiny import build_tiny_model, default_model_dir, is_complete

    target = Path(model_dir).expanduser() if model_dir is not None else default_model_dir()
    if not rebuild and is_complete(target, seed=0):
        if progress:
            say(f"using the tiny model in {target}")
        return target.resolve()
    with Status(f"building the tiny model (once) in {target}", enabled=progress):
        try:
            import mlx_lm  # noqa: F401  (the model is built with mlx-lm's llama)
        except ImportError:
            raise HostNotInstalled(
                f"building the tiny model needs mlx-lm; install it with {INSTALL_HINT['mlx-lm']}"
            ) from None
        return build_tiny_model(target, force=rebuild)


def _announcing_ready_check(announce: Callable[[ServerProcess], None]):
    """``default_ready_check`` that calls ``announce(server)`` on its first poll (the child
    exists then: its pid is known while the host is still starting)."""
    said = False

    def check(server: ServerProcess) -> tuple[bool, str]:
        nonlocal said
        if not said:
            said = True
            announce(server)
        return hostproc.default_ready_check(server)

    return check


@contextlib.contextmanager
def cleanup_signals() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(143)`` (so ``finally`` blocks stop the server); restored
    afterwards. SIGINT keeps Python's KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def stop_quietly(servers: Sequence[ServerProcess | None]) -> None:
    """Stop servers with SIGINT/SIGTERM ignored meanwhile (a second Ctrl-C must not leave
    a half-stopped server behind)."""
    main = threading.current_thread() is threading.main_thread()
    old = {}
    if main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, signal.SIG_IGN)
    try:
        for srv in servers:
            if srv is not None:
                with contextlib.suppress(Exception):
                    srv.stop()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# =============================================================================================
# the demo

QUESTIONS = [
    "Tell me about the bridge and the two rivers.",
    "When does the bakery open, and what does the street smell like?",
    "Which buses leave from the square in the morning?",
    "What happens on market days?",
    "Who repaired the bridge after the flood?",
    "Why must the boats wait for low water?",
    "Describe the morning mist over the water.",
    "How many arches does the old bridge have?",
]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def _speedup(cold: float | None, warm: float | None) -> float | None:
    if not cold or not warm:
        return None
    return cold / warm


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    if abs(n) >= MiB:
        return f"{n / MiB:.2f} MiB"
    if abs(n) >= KiB:
        return f"{n / KiB:.1f} KiB"
    return f"{n:.0f} B"


def _median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def kvplugin_flags(bits: int, min_tokens: int) -> list[str]:
    return ["--kv-cache-quantization", "--kv-cache-quantization-bits", str(bits),
            "--kv-cache-min-quantize-tokens", str(min_tokens)]


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Everything but the printing of the summary; returns the numbers (the ``--json`` data)."""
    spec = host_spec(args.host)
    version = spec.check()
    if os.environ.get("KVPLUGIN_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise DemoFailed("KVPLUGIN_DISABLE is set in this environment: the host would run "
                         "stock and there is nothing to show. Unset it and run again.")
    progress = args.progress
    model_dir = prepare_model(args.model_dir, rebuild=args.rebuild_model, progress=progress)
    maker = TextMaker(model_dir)

    port = args.port or hostproc.free_port()
    host_args = [*kvplugin_flags(args.bits, args.min_quantize_tokens),
                 *spec.budget_args(args.prompt_cache_bytes), *args.host_args]
    cmd = spec.command(model_dir, port, host_args)
    shown = " ".join([spec.label, *host_args])

    def announce(server: ServerProcess) -> None:
        if progress:
            say(f"{spec.label} pid {server.pid} (process group {server.pid}) on {server.url}")

    workdir = Path(tempfile.mkdtemp(prefix="kvplugin-demo-"))  # the server's HOME and log
    srv = ServerProcess(cmd, port=port, env=dict(spec.env), model=spec.model, workdir=workdir,
                        startup_timeout=args.startup_timeout,
                        ready_check=_announcing_ready_check(announce), name=spec.label)
    result: dict[str, Any] = {
        "host": spec.name, "host_version": version, "command": shown, "model_dir": str(model_dir),
        "port": port, "turns": [], "bits": args.bits,
    }
    keep_log = True  # only when something went wrong
    try:
        try:
            with Status(f"starting {spec.label} {version} on {srv.url}", enabled=progress):
                srv.start()
        except ServerStartError as err:
            raise DemoFailed(f"{spec.label} did not start:\n{err}") from None
        result["startup_s"] = srv.startup_seconds

        stats0 = get_stats(srv)
        if stats0 is None:
            raise DemoFailed(_inactive_message(srv, spec))

        with Status(f"holding a {args.turns}-turn conversation", enabled=progress) as st:
            # A short unrelated request first: the server's first request pays one-time
            # set-up costs that are not prefill; "cold" below is a prefix not in the cache.
            timed_chat(srv, [{"role": "user", "content": "Hello."}], max_tokens=1)
            system = ("You are the guide of a small river town. Answer visitors' questions "
                      "from these notes. " + maker.text(args.system_tokens, "demo-system", "Notes"))
            history: list[dict[str, str]] = [{"role": "system", "content": system}]
            for t in range(args.turns):
                st.note = f", turn {t + 1}/{args.turns}"
                history.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                r = stream_chat(srv, history, max_tokens=args.max_tokens)
                history.append({"role": "assistant", "content": r.text})
                result["turns"].append({"turn": t + 1, **r.to_dict()})
            # The same measurement with whole 1-token requests: a new system prompt of the
            # same size (cold), then the same conversation's next turn (warm).
            st.note = ", 1-token timing"
            other = ("You are the guide of a small river town. Answer visitors' questions "
                     "from these notes. " + maker.text(args.system_tokens, "demo-other", "Notes"))
            conv = [{"role": "system", "content": other},
                    {"role": "user", "content": QUESTIONS[0]}]
            cold1 = timed_chat(srv, conv, max_tokens=1)
            conv += [{"role": "assistant", "content": cold1.text},
                     {"role": "user", "content": QUESTIONS[1]}]
            warm1 = timed_chat(srv, conv, max_tokens=1)
            result["one_token"] = {"cold": cold1.to_dict(), "warm": warm1.to_dict()}
            st.note = ""
        stats = get_stats(srv)
        if stats is None:
            raise DemoFailed("GET /kvplugin/stats stopped answering during the conversation; "
                             f"server log tail:\n{srv.log_tail(30)}")
        result["stats"] = stats
        keep_log = False
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C / SIGTERM: the user stopped it
        keep_log = False
        raise
    finally:
        with Status(f"stopping {spec.label}", enabled=progress and srv.proc is not None):
            stop_quietly([srv])
        if not keep_log:
            shutil.rmtree(workdir, ignore_errors=True)
        elif srv.proc is not None and srv.log_path.exists():
            say(f"the server's log is kept in {srv.log_path}")
    result["summary"] = _summary(result)
    return result


def _inactive_message(srv: ServerProcess, spec: HostSpec) -> str:
    log = srv.log_text()
    lines = [ln for ln in log.splitlines() if "kvplugin" in ln]
    why = "\n  ".join(lines[-5:]) if lines else "(no kvplugin line in the server log)"
    return (
        f"kvplugin is not active in {spec.label}: GET {STATS_PATH} does not answer, so there "
        f"is nothing to show. Possible causes: KVPLUGIN_DISABLE is set, the host version is "
        f"outside kvplugin's range, or the adapter failed to patch the host. The server "
        f"said:\n  {why}\nFull log: {srv.log_path}"
    )


def _summary(result: Mapping[str, Any]) -> dict[str, Any]:
    stats = result["stats"]
    turns = result["turns"]
    entries = stats.get("entries")
    held_dense = sum(e.get("dense_nbytes", 0) for e in entries) if entries else None
    held_tokens = sum(e.get("tokens", 0) for e in entries) if entries else None
    cold_stream = turns[0]["ttft_s"] if turns else None
    warm_stream = _median([t["ttft_s"] for t in turns[1:]])
    one = result["one_token"]
    return {
        "entries_stored": stats.get("entries_stored", 0),
        "entries_quantized": stats.get("entries_quantized", 0),
        "hits": stats.get("store_hits", 0),
        "misses": stats.get("store_misses", 0),
        "tokens_reused": stats.get("store_tokens_reused", 0),
        "entries_held": stats.get("store_entries"),
        "held_tokens": held_tokens,
        "held_bytes_fp16": held_dense,
        "held_bytes_stored": stats.get("store_bytes"),
        "host_bytes": stats.get("bytes_before"),
        "stored_bytes": stats.get("bytes_stored"),
        "system_prompt_tokens": (turns[0]["prompt_tokens"] if turns else None),
        "ttft_stream_cold_s": cold_stream,
        "ttft_stream_warm_s": warm_stream,
        "ttft_stream_speedup": _speedup(cold_stream, warm_stream),
        "ttft_1tok_cold_s": one["cold"]["ttft_s"],
        "ttft_1tok_warm_s": one["warm"]["ttft_s"],
        "ttft_1tok_speedup": _speedup(one["cold"]["ttft_s"], one["warm"]["ttft_s"]),
    }


def format_report(result: Mapping[str, Any]) -> str:
    s = result["summary"]
    stats = result["stats"]
    q = stats.get("quantization")
    out = [
        f"kvplugin demo: {result['host']} {result['host_version']}, tiny local model "
        f"(random weights: the answers are gibberish; the cache is real)",
        f"  server: {result['command']}",
        "",
        f"conversation ({s['system_prompt_tokens']} prompt tokens in turn 1, "
        f"{len(result['turns'])} turns, streamed):",
    ]
    for t in result["turns"]:
        text = " ".join((t["text"] or "").split())
        text = text[:38] + ("..." if len(text) > 38 else "")
        out.append(f"  turn {t['turn']}: prompt {t['prompt_tokens'] or '?':>5} tokens, "
                   f"cached {t['cached_tokens'] if t['cached_tokens'] is not None else '?':>5}, "
                   f"first token after {_ms(t['ttft_s']):>7}   {text!r}")
    quant = (f"{q['bits']}-bit, group {q['group_size']}, entries from {q['min_tokens']} tokens"
             if q else "off")
    ratio_held = (s["held_bytes_stored"] / s["held_bytes_fp16"]
                  if s["held_bytes_fp16"] and s["held_bytes_stored"] is not None else None)
    ratio_all = (s["stored_bytes"] / s["host_bytes"] if s["host_bytes"] else None)
    out += [
        "",
        f"what kvplugin did (GET {STATS_PATH}):",
        f"  entries stored       {s['entries_stored']}  ({s['entries_quantized']} quantized; "
        f"quantization {quant})",
        f"  cache hits           {s['hits']}  (misses {s['misses']}; "
        f"{s['tokens_reused']} prompt tokens reused)",
    ]
    if s["held_bytes_fp16"] is not None:
        out.append(
            f"  held now             {s['entries_held']} entries, {s['held_tokens']} tokens: "
            f"{_fmt_bytes(s['held_bytes_fp16'])} at fp16 -> {_fmt_bytes(s['held_bytes_stored'])} "
            f"as stored" + (f" ({ratio_held:.3f}x)" if ratio_held is not None else ""))
    else:
        out.append(f"  held now             {s['entries_held']} entries, "
                   f"{_fmt_bytes(s['held_bytes_stored'])} as stored")
    out.append(
        f"  all entries stored   {_fmt_bytes(s['host_bytes'])} handed over by the host (fp16 "
        f"live caches) -> {_fmt_bytes(s['stored_bytes'])} stored (trimmed"
        f"{', quantized' if q else ''}; "
        + (f"{ratio_all:.3f}x)" if ratio_all is not None else "-)"))

    def row(name: str, cold, warm, sp, how: str) -> str:
        spd = f"{sp:5.1f}x faster" if sp else "     -"
        return f"  {name:<16} cold {_ms(cold):>8}   warm {_ms(warm):>8}   {spd}   ({how})"

    out += [
        "",
        "time to first token (cold: the prompt's prefix is not cached; warm: the conversation "
        "so far is):",
        row("streaming", s["ttft_stream_cold_s"], s["ttft_stream_warm_s"], s["ttft_stream_speedup"],
            "first streamed token; turn 1 vs median of later turns"),
        row("1-token request", s["ttft_1tok_cold_s"], s["ttft_1tok_warm_s"], s["ttft_1tok_speedup"],
            "whole request, max_tokens=1; new system prompt vs its next turn"),
        "",
        "the server was stopped.",
    ]
    return "\n".join(out)


def build_parser(prog: str = "kvplugin demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Start an installed host on a tiny local model with kvplugin's options, "
                    "hold a short conversation, stop the server and show what kvplugin did "
                    "(entries, bytes, hits, time to first token). Offline; the model is built "
                    "once and reused.",
        epilog="Extra host arguments go after `--`, e.g. "
               "`kvplugin demo -- --kv-cache-quantization-bits 4 --max-kv-size 4096` "
               "(later flags win over the demo's defaults).",
    )
    p.add_argument("--host", choices=HOSTS, default="mlx-lm",
                   help="which installed host to start (default: mlx-lm)")
    p.add_argument("--bits", type=int, choices=range(2, 9), default=8, metavar="{2..8}",
                   help="--kv-cache-quantization-bits for the stored entries (default 8)")
    p.add_argument("--min-quantize-tokens", type=int, default=64, metavar="N",
                   help="--kv-cache-min-quantize-tokens (default 64)")
    p.add_argument("--prompt-cache-bytes", type=_size, default=64 * MiB, metavar="SIZE",
                   help="prompt-cache budget passed to the host (mlx-lm --prompt-cache-bytes, "
                        "vllm-mlx --cache-memory-mb); accepts K/M/G suffixes (default 64M)")
    p.add_argument("--turns", type=int, default=4, choices=range(2, 9), metavar="{2..8}",
                   help="user turns in the conversation (default 4)")
    p.add_argument("--system-tokens", type=int, default=1024, metavar="N",
                   help="length of the system prompt in tokens (default 1024)")
    p.add_argument("--max-tokens", type=int, default=24, metavar="N",
                   help="tokens generated per turn (default 24)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="where the tiny model is (built there if missing; default "
                        "$KVPLUGIN_HOME/tiny-model-v1 or ~/.cache/kvplugin/tiny-model-v1)")
    p.add_argument("--rebuild-model", action="store_true", help="rebuild the tiny model")
    p.add_argument("--port", type=int, default=None, help="port on 127.0.0.1 (default: a free one)")
    p.add_argument("--startup-timeout", type=float, default=180.0, metavar="S",
                   help="seconds to wait for the server (default 180)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="also write the numbers to FILE as JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no status lines on stderr")
    p.add_argument("host_args", nargs="*", metavar="-- HOST_ARGS",
                   help="extra arguments for the host server, after `--`")
    return p


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M, 1G, 500000)")
    scale = {"": 1, "k": KiB, "m": MiB, "g": 1 << 30}[m.group(2).lower()]
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError("the size must be positive")
    return value


def run(args: argparse.Namespace) -> int:
    """Run the demo for parsed ``args``; returns the exit code."""
    if args.system_tokens < 64 or args.max_tokens < 1:
        print("kvplugin demo: need --system-tokens >= 64 and --max-tokens >= 1", file=sys.stderr)
        return 2
    with cleanup_signals():
        try:
            result = run_demo(args)
        except KeyboardInterrupt:
            print("\nkvplugin demo: interrupted; the server was stopped.", file=sys.stderr)
            return 130
        except (DemoFailed, HostNotInstalled) as err:
            print(f"kvplugin demo: {err}", file=sys.stderr)
            return 1
    print(format_report(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    s = result["summary"]
    if not s["entries_stored"]:
        print("kvplugin demo: kvplugin stored no entry: it is not working in this server.",
              file=sys.stderr)
        return 1
    if not s["hits"]:
        print("kvplugin demo: no request reused a stored entry: the prompt cache is not "
              "working in this server.", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
