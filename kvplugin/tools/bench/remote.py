"""Replicas sharing a Redis: ``kvplugin bench --server --remote``.

Real ``mlx_lm.server`` processes and a real ``redis-server`` on 127.0.0.1. For each prefix
size (1k/2k/4k tokens of real text by default):

* **cold**: a stock server (``KVPLUGIN_DISABLE=1``) answers the prompt: the time to first
  token of a full prefill;
* **warm from the remote tier**: kvplugin replica A answers one question on the prefix (and
  publishes it), then replica B, which never saw it, answers another: B's time to first
  token, the prompt tokens it reused (``cached_tokens``) and the bytes it read from Redis;
* **miss overhead**: B answers a prompt no replica has seen; stock answers the same prompt.
  The difference is noise-prone, so the time B spent waiting on Redis for that miss
  (``remote_fetch_seconds``) is reported too;

at fp16 and with 8-bit entries (``--kv-cache-quantization``). Every time is the client's
clock on a streamed request. The model is the real SmolLM2-135M-Instruct (float32, with
OpenBLAS preloaded on Linux, stock and kvplugin alike) unless ``--tiny``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from kvplugin.tools import hostcmd, hostproc
from kvplugin.tools.client import stream_chat
from kvplugin.tools.redisproc import RedisServer

SIZES = (1024, 2048, 4096)


def _prefix(words: list[str], size: int, salt: int, count) -> str:
    """``size`` tokens (by the model's tokenizer, ``count``) of real text, different for
    every (size, salt)."""
    start = (salt * 997) % max(1, len(words) - 1)
    n = size
    while True:
        picked = [words[(start + i) % len(words)] for i in range(n)]
        text = f"Document {salt}. " + " ".join(picked)
        got = count(text)
        if got <= size:
            return text
        n = max(1, int(n * size / got) - 1)


def _stats(srv: Any) -> dict:
    return srv.get("/kvplugin/stats")


def _wait_published(srv: Any, puts: int) -> None:
    deadline = time.monotonic() + 120
    while _stats(srv)["remote_puts"] <= puts:
        if time.monotonic() > deadline:
            raise RuntimeError(f"replica A did not publish: {_stats(srv)}")
        time.sleep(0.05)


def _ask(srv: Any, prefix: str, question: str) -> Any:
    return stream_chat(srv, [{"role": "system", "content": prefix},
                             {"role": "user", "content": question}], max_tokens=4)


def measure(model: Path, sizes: Sequence[int], work: Path, env: dict, words: list[str]) -> list:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    rows = []
    with RedisServer() as redis:
        servers: dict[str, Any] = {}

        def start(name: str, *extra: str, disable: bool = False) -> Any:
            port = hostcmd.free_port()
            srv = hostproc.ServerProcess(
                hostcmd.mlx_lm_server_cmd(model, port, *extra), port=port,
                env={**env, **({"KVPLUGIN_DISABLE": "1"} if disable else {})},
                workdir=work / name, startup_timeout=300)
            servers[name] = srv.start()
            return servers[name]

        try:
            stock = start("stock", disable=True)
            for label, extra in (("fp16", ()), ("8-bit", ("--kv-cache-quantization",))):
                remote = ("--kv-cache-remote", redis.url, *extra)
                a, b = start(f"a-{label}", *remote), start(f"b-{label}", *remote)
                for i, size in enumerate(sizes):
                    prefix = _prefix(words, size, i + (0 if label == "fp16" else 50), count)
                    cold = _ask(stock, prefix, "What is the second question?")
                    puts = _stats(a)["remote_puts"]
                    _ask(a, prefix, "What is the first question?")
                    _wait_published(a, puts)
                    before = _stats(b)
                    warm = _ask(b, prefix, "What is the second question?")
                    after = _stats(b)
                    fresh = _prefix(words, size, 100 + i + (0 if label == "fp16" else 50), count)
                    stock_miss = _ask(stock, fresh, "Summarize.")
                    seconds = _stats(b)["remote_fetch_seconds"]
                    miss = _ask(b, fresh, "Summarize.")
                    rows.append({
                        "entries": label, "prefix_tokens": size,
                        "prompt_tokens": warm.prompt_tokens,
                        "cold_ttft_s": cold.ttft_s, "warm_remote_ttft_s": warm.ttft_s,
                        "cached_tokens": warm.cached_tokens,
                        "bytes_per_hit": after["remote_bytes_read"] - before["remote_bytes_read"],
                        "same_answer": warm.text == cold.text,
                        "miss_ttft_stock_s": stock_miss.ttft_s, "miss_ttft_kvplugin_s": miss.ttft_s,
                        "miss_remote_wait_s": _stats(b)["remote_fetch_seconds"] - seconds,
                    })
                    print(json.dumps(rows[-1]), flush=True)  # partial results survive a kill
                for srv in (a, b):
                    srv.stop()
        finally:
            for srv in servers.values():
                srv.stop()
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'entries':<7} {'prompt':>6} {'cold TTFT (stock)':>17} {'warm TTFT (B, remote)':>21} "
            f"{'reused':>6} {'MiB/hit':>7} {'same':>5} {'miss TTFT stock':>15} "
            f"{'miss TTFT kvplugin':>18} {'miss wait on Redis':>18}")
    out = [head]
    for r in rows:
        out.append(
            f"{r['entries']:<7} {r['prompt_tokens'] or 0:>6} {1000 * r['cold_ttft_s']:>14.0f} ms "
            f"{1000 * r['warm_remote_ttft_s']:>18.0f} ms {r['cached_tokens'] or 0:>6} "
            f"{r['bytes_per_hit'] / 2**20:>7.2f} {str(r['same_answer']):>5} "
            f"{1000 * r['miss_ttft_stock_s']:>12.0f} ms {1000 * r['miss_ttft_kvplugin_s']:>15.0f} ms "
            f"{1000 * r['miss_remote_wait_s']:>15.1f} ms")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvplugin bench --server --remote",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--remote", action="store_true", help="(selects this bench)")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny offline model instead of SmolLM2 (seconds; no real prefill)")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES,
                   help="prefix sizes in tokens, comma-separated (default 1024,2048,4096)")
    p.add_argument("--out", type=Path, default=Path("bench-results/remote"))
    args = p.parse_args(argv)
    env: dict[str, str] = {}
    if not args.tiny:
        from kvplugin.tools import blas

        if (rc := blas.rerun_preloaded("kvplugin.tools.bench.remote", argv)) is not None:
            return rc
    from kvplugin.tools.models import realtext

    words = " ".join(realtext.paragraphs()).split()
    with tempfile.TemporaryDirectory(prefix="kvplugin-remote-bench-") as tmp:
        if args.tiny:
            from kvplugin.tools.models.tiny import build_tiny_model

            model, name = build_tiny_model(Path(tmp) / "model"), "tiny random llama"
        else:
            from kvplugin.tools.models.smollm2 import build_smollm2

            model, name = build_smollm2(), "SmolLM2-135M-Instruct float32"
        rows = measure(model, args.sizes, Path(tmp), dict(env), words)
    import mlx_lm

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "remote.json").write_text(json.dumps(rows, indent=1))
    text = (f"kvplugin bench --server --remote: mlx_lm.server {mlx_lm.__version__}, {name}, "
            f"OpenBLAS preloaded: {'openblas' in os.environ.get('LD_PRELOAD', '')}; a real "
            f"redis-server on 127.0.0.1; TTFT = first streamed token, client clock; cold = stock "
            f"(KVPLUGIN_DISABLE=1) prefilling the prompt; warm = kvplugin replica B reusing "
            f"what replica A published; MiB/hit = B's remote_bytes_read for that request; "
            f"miss wait = B's remote_fetch_seconds on a prompt no replica had seen\n\n"
            + table(rows))
    (args.out / "remote.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
