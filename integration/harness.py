"""Integration-test face of :mod:`kvplugin.tools.hostcmd` and :mod:`kvplugin.tools.hostproc`
plus the pytest glue."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable, Mapping

from kvplugin.tools.hostcmd import *  # noqa: F403  (the harness API)
from kvplugin.tools.hostcmd import (
    SERVED_MODEL_NAME,
    free_port,
    mlx_openai_server_cmd,
    vllm_mlx_serve_cmd,
)
from kvplugin.tools.hostproc import *  # noqa: F403  (the harness API)
from kvplugin.tools.hostproc import ServerProcess

# --------------------------------------------------------------------------- #
# pytest glue


def server_fixture(
    cmd: Callable[..., list[str]],
    *extra: str,
    env: Mapping[str, str | None] | None = None,
    model: str | None = None,
    scope: str = "module",
    **kwargs: Any,
):
    """A pytest fixture that starts ``cmd(tiny_model, free_port(), *extra)``
    once per ``scope`` and stops it afterwards; needs the ``tiny_model``
    fixture (integration/conftest.py). ``model`` defaults to
    :data:`SERVED_MODEL_NAME` for :func:`vllm_mlx_serve_cmd`, else None::

        server = server_fixture(mlx_lm_server_cmd, env={"KVPLUGIN_DISABLE": "1"})
    """
    import pytest

    if model is None and cmd in (vllm_mlx_serve_cmd, mlx_openai_server_cmd):
        model = SERVED_MODEL_NAME

    @pytest.fixture(scope=scope)
    def _server(tiny_model, tmp_path_factory):
        port = free_port()
        srv = ServerProcess(cmd(tiny_model, port, *extra), port=port, env=env, model=model,
                            workdir=tmp_path_factory.mktemp(cmd.__name__), **kwargs)
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()

    return _server


# --------------------------------------------------------------------------- #
# admission control (--max-memory)


def assert_busy_then_served(srv: ServerProcess, first: str, second: str, *, limit: int,
                            max_tokens: int = 300) -> None:
    """Two large requests at once under ``--max-memory``: while ``first`` is in flight,
    ``second`` gets one 503 with ``Retry-After``; once ``first`` is answered, the retry is
    served; nothing stays reserved and MLX's peak stayed within ``limit``."""
    import threading
    import time

    import pytest

    from kvplugin.tools.hostproc import ServerHTTPError

    before = srv.get("/kvplugin/stats")
    results: dict[str, Any] = {}

    def run_first() -> None:
        try:  # long enough a decode that it is still in flight when the second arrives
            results["first"] = srv.chat(first, max_tokens=max_tokens)
        except Exception as exc:  # pragma: no cover - reported below
            results["first"] = exc

    thread = threading.Thread(target=run_first)
    thread.start()
    deadline = time.monotonic() + 60
    while srv.get("/kvplugin/stats")["admission_reserved"] == 0:
        assert time.monotonic() < deadline, "the first request was never admitted"
        time.sleep(0.02)
    with pytest.raises(ServerHTTPError) as err:
        srv.chat(second, max_tokens=max_tokens)
    assert err.value.status == 503, err.value
    assert err.value.headers.get("Retry-After"), err.value.headers
    thread.join(timeout=300)
    assert answer_text(results["first"]).strip(), results
    assert answer_text(srv.chat(second, max_tokens=max_tokens)).strip()
    after = wait_released(srv)
    assert after["refused_busy"] == before["refused_busy"] + 1
    # what MLX ever held stayed within the limit: the ledger reserves upper bounds
    assert after["mlx_peak_memory"] <= limit, (after["mlx_peak_memory"], limit)


def briefing(i: int) -> dict:
    """A long system message of real text, different for every ``i`` (a fresh prefix)."""
    from kvplugin.tools.models.corpus import CORPUS

    paragraphs = [p.replace("\n", " ").strip() for p in CORPUS.split("\n\n") if p.strip()]
    text = " ".join(paragraphs[(i + j) % len(paragraphs)] for j in range(3))
    return {"role": "system", "content": f"Briefing {i}. {text}"}


def wait_published(srv: ServerProcess, n: int, timeout: float = 30.0,
                   quiet: float = 1.0, *, stored: int = 0, tokens: int = 0) -> dict:
    """Wait until ``srv`` has written ``n`` entries to the remote tier and then gone
    ``quiet`` seconds with nothing queued and no further write; its stats. With ``stored``
    and ``tokens``: only once it has stored that many entries in all and holds one of at
    least ``tokens`` tokens (the request the caller waits for).

    The host may store more than one entry per request (mlx-lm 0.32's batched path stores
    the system-prompt segment, then the whole conversation once the answer is sent), so
    the n-th write alone does not mean the request's writes are done; and a host stores after
    it answers, so on a loaded machine the quiet time could pass before the entry was even
    stored (a replica then missed it in CI): the entry itself is what is waited for."""
    import time

    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        stats = srv.get("/kvplugin/stats")
        state = (stats["remote_puts"], stats["remote_queued_bytes"])
        held = stats["entries_stored"] >= stored and (
            not tokens or any(e["tokens"] >= tokens for e in stats["entries"]))
        if state != last or not held:
            last, since = state, time.monotonic()
        elif (stats["remote_puts"] >= n and not stats["remote_queued_bytes"]
              and time.monotonic() - since >= quiet):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def wait_released(srv: ServerProcess, timeout: float = 10.0) -> dict:
    """The stats once no admission reservation is held. The host answers, then its
    generation thread finishes the request and releases it; one that stays is a leak."""
    import time

    deadline = time.monotonic() + timeout
    while (stats := srv.get("/kvplugin/stats"))["admission_reserved"] != 0:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


_REFERENCE_SCRIPT = """
import json, sys
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache
model_dir, messages, n, max_tokens, prefill_step = json.loads(sys.argv[1])
model, tok = load(model_dir)
prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
cache = [RotatingKVCache(n, keep=4) for _ in model.layers]
out = []
for token, _ in generate_step(mx.array(prompt), model, prompt_cache=cache,
                              max_tokens=max_tokens, prefill_step_size=prefill_step):
    if int(token) in tok.eos_token_ids:
        break
    out.append(int(token))
print(json.dumps([len(prompt), tok.decode(out)]))
"""


@functools.lru_cache(maxsize=None)
def _bounded_reference(args: str) -> tuple[int, str]:
    import subprocess
    import sys

    from kvplugin.tools import blas

    out = subprocess.run([sys.executable, "-c", _REFERENCE_SCRIPT, args], capture_output=True,
                         text=True, timeout=600, env={**os.environ, **blas.preload_env()})
    assert out.returncode == 0, out.stderr[-3000:]
    n_prompt, text = json.loads(out.stdout.strip().splitlines()[-1])
    return n_prompt, text


def bounded_reference(model_dir: Any, messages: list, n: int, max_tokens: int,
                      prefill_step: int = 2048) -> tuple[int, str]:
    """mlx-lm's own bounded generation, greedy: ``RotatingKVCache(n, keep=4)`` on every layer
    (what ``mlx_lm.generate --max-kv-size n`` builds for a plain model), the prompt prefilled
    in ``prefill_step`` chunks. Returns (prompt tokens, answer). Run in a child process with
    OpenBLAS preloaded, like the servers it is compared with (float32 matmuls are ~40x slower
    without it here); cached per arguments."""
    return _bounded_reference(json.dumps([str(model_dir), messages, n, max_tokens,
                                          prefill_step]))


def streamed_pair(srv: Any, messages: list, max_tokens: int) -> list[str]:
    """Two identical streamed requests at once; asserts they were served in one batch (each
    one's first token arrives before the other's last) and returns both answers."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from kvplugin.tools.client import stream_chat

    def one(_: int) -> tuple[float, float, str]:
        start = time.perf_counter()
        reply = stream_chat(srv, messages, max_tokens=max_tokens)
        assert reply.token_times, reply
        return start + reply.token_times[0], start + reply.token_times[-1], reply.text

    with ThreadPoolExecutor(2) as pool:
        (first_a, last_a, a), (first_b, last_b, b) = pool.map(one, range(2))
    assert first_a < last_b and first_b < last_a, "the two requests were not batched"
    return [a, b]


def quantized_size_bound(entry: Mapping[str, Any], quantization: Mapping[str, Any]) -> float:
    """The most bytes a stored entry (a ``/kvplugin/stats`` ``entries`` item) may take under
    the server's resolved ``quantization`` (its stats): keys and values at their bits plus
    2 bytes of scale and of minimum per group (per-channel keys: one row per started group
    of tokens), plus the tokens the entry says it keeps at full precision, which must be no
    more than the sinks and the recent tokens, once more before each of at most 8 earlier
    prompts' ends (prompt boundaries)."""
    n, dense = entry["tokens"], entry["dense_nbytes"]
    group, half, codec = quantization["group_size"], dense / 2, quantization["codec"]
    rows = -(-n // group) * group / n if codec.startswith("rotated-channel") else 1
    keys = half * (quantization["key_bits"] / 16 + 2 / group * rows)
    scale_only = codec == "rotated-channel-sym"  # values: a scale and no minimum per group
    values = half * (quantization["value_bits"] / 16 + (1 if scale_only else 2) / group)
    kept = entry["full_precision_tokens"]
    assert kept <= min(n, quantization["sink_tokens"] + 9 * quantization["recent_tokens"]), entry
    return keys + values + kept * dense / n + 64


# --------------------------------------------------------------------------- #
# start-ups that must fail


def failed_start(args: list[str], port: int, env: Mapping[str, str | None] | None = None,
                 timeout: float = 120.0) -> tuple[Any, bool]:
    """Run a server command that must stop at start-up, connecting to its ``port`` every
    20 ms while it runs: ``(the finished process, whether the port ever accepted)``. A
    server that accepts is stopped at once (it did not stop by itself), as is one still
    running after ``timeout`` seconds."""
    import contextlib
    import signal
    import socket
    import subprocess
    import tempfile
    import time
    from pathlib import Path

    from kvplugin.tools.hostcmd import HOST, server_env

    with tempfile.TemporaryDirectory(prefix="kvplugin-start-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        with open(Path(tmp) / "out", "w+") as out, open(Path(tmp) / "err", "w+") as err:
            proc = subprocess.Popen([str(a) for a in args], env=server_env(home, env), cwd=home,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            accepted, deadline = False, time.monotonic() + timeout
            try:
                while proc.poll() is None and not accepted and time.monotonic() < deadline:
                    try:
                        socket.create_connection((HOST, port), timeout=0.05).close()
                        accepted = True
                    except OSError:
                        time.sleep(0.02)
            finally:
                with contextlib.suppress(ProcessLookupError):  # the group, children included
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(),
                                               err.read()), accepted


def as_plain_user(args: list[str]) -> list[str]:
    """``args`` run without root's way around file modes: as root (CI, this machine) behind
    ``setpriv`` with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped, so a mode-000
    directory cannot be listed and a mode-555 one cannot be written, as for any user; as any
    other user, unchanged. Files the server needs must be its owner's (they are: root's)."""
    import shutil

    if os.geteuid() != 0:
        return list(args)
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to run a server as root without DAC override"
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--", *args]


#: The ways an ``--ssd-cache-dir`` cannot be used at all (see :func:`unusable_ssd_dir`).
UNUSABLE_SSD_DIRS = ("cannot-be-created", "a-file", "unreadable")


def unusable_ssd_dir(kind: str, where: Any) -> tuple[str, Callable[[list[str]], list[str]]]:
    """An SSD directory the tier cannot use, made under ``where`` (a pytest tmp_path), and
    how to wrap the server command so it meets it as the user it is meant for:
    ``cannot-be-created`` is under ``/proc`` (no one creates directories there, root
    included); ``a-file`` is a regular file; ``unreadable`` is mode 000, met without root's
    way around file modes (:func:`as_plain_user`)."""
    import uuid
    from pathlib import Path

    if kind == "cannot-be-created":
        return f"/proc/kvplugin-{uuid.uuid4().hex[:8]}/kv", list
    path = Path(where) / "kv"
    if kind == "a-file":
        path.write_text("not a directory\n")
        return str(path), list
    assert kind == "unreadable", kind
    path.mkdir()
    path.chmod(0o000)
    return str(path), as_plain_user


def assert_refused_ssd_dir(result: Any, accepted: bool, given: str) -> None:
    """The start-up stopped as a bad ``--ssd-cache-dir`` must: exit 2 before the port ever
    accepted, naming the flag, the variable and how the value was given (``given``)."""
    err = " ".join(result.stderr.split())
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert not accepted, "the port accepted a connection before the server stopped"
    assert "--ssd-cache-dir" in err and "KVPLUGIN_SSD_CACHE_DIR" in err, result.stderr[-3000:]
    assert given in err, (given, result.stderr[-3000:])
    assert "runs stock" not in err, result.stderr[-3000:]


def wait_cold_tier(srv: ServerProcess, key: str, n: int, timeout: float = 15.0) -> dict:
    """The cold tier's stats once its counter ``key`` reached ``n`` (hosts store and spill
    after answering); fails when it does not in ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        tier = srv.get("/kvplugin/stats")["cold_tier"]
        if tier[key] >= n:
            return tier
        assert time.monotonic() < deadline, (key, n, tier)
        time.sleep(0.1)


def plugin_on_path(where: Any, name: str, source: str) -> dict[str, str]:
    """Env that installs ``source`` as kvplugin plugin ``name`` the way a distribution does: a
    module ``kvp_<name>`` and a ``kvplugin`` entry point, on ``PYTHONPATH`` (so a server loads
    it through the real plugin discovery, not a test hook)."""
    from pathlib import Path

    where, module = Path(where), f"kvp_{name}"
    (where / f"{module}.py").write_text(source)
    dist = where / f"{module}-1.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvp-{name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[kvplugin]\n{name} = {module}\n")
    return {"PYTHONPATH": str(where)}


def check_salt_crosses_redis(one: ServerProcess, two: ServerProcess, redis_server: Any,
                             ask: Callable, system: str, salt_a: str, salt_b: str) -> None:
    """A prefix ``one`` published under ``salt_a`` is a miss for ``two`` under ``salt_b`` (the
    tier not even asked) and a hit under ``salt_a``; no salt appears in clear in Redis.
    ``ask(srv, system, question, salt)`` returns the response."""
    from kvplugin.cache.tiers.remote_keys import PREFIX

    before = one.get("/kvplugin/stats")
    ask(one, system, "Describe the morning mist.", salt_a)
    wait_published(one, before["remote_puts"] + 1, stored=before["entries_stored"] + 1)
    before = two.get("/kvplugin/stats")
    miss = ask(two, system, "Where is the market?", salt_b)
    assert cached_tokens(miss) == 0, miss["usage"]
    mid = two.get("/kvplugin/stats")
    assert mid["remote_hits"] == before["remote_hits"], mid
    hit = ask(two, system, "Where is the market?", salt_a)
    assert cached_tokens(hit) >= hit["usage"]["prompt_tokens"] // 2, (
        hit["usage"], {k: v for k, v in two.get("/kvplugin/stats").items()
                       if k.startswith("remote_")})
    assert two.get("/kvplugin/stats")["remote_hits"] == mid["remote_hits"] + 1
    keys = [k.decode() for k in redis_server.client().keys(PREFIX + ":*")]
    assert keys and not any(salt_a in k or salt_b in k for k in keys)  # hashed, never in clear

