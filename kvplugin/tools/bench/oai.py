"""``python -m kvplugin.tools.bench.oai``: mlx-openai-server, stock beside kvplugin, one run.

Why its own bench: stock mlx-openai-server keeps no entry in memory; it pickles the whole KV
cache into ``--prompt-cache-dir`` on the request's thread at every insert and unpickles it at
every hit. So this measures, per model (the tiny model and SmolLM2-135M):

* the entry itself, in process: the time the caller's thread spends in ``insert_cache``
  (stock: ``dill`` to a file; kvplugin: trim, maybe quantize, held in memory until another
  request, then a checked safetensors file, "via its file", or the memory tier under
  ``--hot-cache-only``) and in ``fetch_nearest_cache`` (stock: unpickle; kvplugin: move out,
  or read and check the file), the bytes each counts against
  ``--max-bytes``, and how many conversations a fixed budget holds;
* real servers (``mlx-openai-server launch``, batched or ``--disable-batching``): a multi-turn
  conversation's warm time to first token, the prompt tokens each reports reused, the
  answers, and the model process's ``VmHWM`` growth across the conversation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

MIB = 1 << 20
#: each server's environment: stock, kvplugin's default (fp16 entries in files), 8-bit
#: entries, fp16 entries in memory (``--hot-cache-only``), and 8-bit entries under the
#: pressure policy (full precision while held, quantized when written out)
SERVER_KINDS = {"stock": {"KVPLUGIN_DISABLE": "1"}, "kvplugin fp16": {},
                "kvplugin 8-bit": {"KVPLUGIN_KV_CACHE_QUANTIZATION": "1"},
                "kvplugin fp16 in memory": {"KVPLUGIN_HOT_CACHE_ONLY": "1"},
                "kvplugin 8-bit pressure": {"KVPLUGIN_KV_CACHE_QUANTIZATION": "1",
                                            "KVPLUGIN_KV_CACHE_QUANTIZATION_POLICY": "pressure"}}


def _filled_cache(model: Any, tokens: list[int]) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _evaluated(cache: list) -> None:
    import mlx.core as mx

    mx.eval([c.state for c in cache])


def _kvplugin_cache(bits: int | None, cache_dir: str, *, in_memory: bool = False) -> Any:
    """kvplugin's prompt cache of the host on the service its adapter builds (fp16 or
    ``bits`` entries), its entries where the adapter keeps them (``cache_dir``), or in memory."""
    from kvplugin.hosts.mlx_openai_server.adapter import ADAPTER
    from kvplugin.hosts.mlx_openai_server.prompt_cache import KVPluginOaiPromptCache

    flags: dict[str, Any] = {"hot_cache_only": in_memory}
    if bits is not None:
        flags.update(kv_cache_quantization=True, kv_cache_quantization_bits=bits)
    service, _ = ADAPTER.build_service(cache_dir, None, max_entries=10, flags=flags)
    KVPluginOaiPromptCache.adapter = types.SimpleNamespace(
        create_service=lambda **kw: (service, None))
    return KVPluginOaiPromptCache(10, 1 << 63, cache_dir)


def store_costs(model_dir: Path, prompt_tokens: int, repeats: int, budget: int) -> dict:
    """Insert and fetch of one entry, stock's pickles beside kvplugin's tiers, in process."""
    from mlx_lm import load

    from kvplugin.tools.prompts import TextMaker

    model, tokenizer = load(str(model_dir))
    tokens = list(tokenizer.encode(TextMaker(model_dir).text(prompt_tokens, seed="oai-store")))
    probe = [*tokens, tokens[0]]
    rows: dict[str, dict] = {}
    for name, bits in (("stock", None), ("kvplugin fp16", None), ("kvplugin 8-bit", 8),
                       ("kvplugin fp16, via its file", None),
                       ("kvplugin 8-bit, via its file", 8),
                       ("kvplugin fp16 --hot-cache-only", None)):
        insert_s, fetch_s, held = [], [], 0
        for _ in range(repeats):
            cache = _filled_cache(model, tokens)
            with tempfile.TemporaryDirectory(prefix="oai-bench-") as tmp:
                if name == "stock":
                    from app.utils.prompt_cache import LRUPromptCache

                    store = LRUPromptCache(max_size=10, cache_dir=tmp)
                else:
                    store = _kvplugin_cache(bits, tmp, in_memory="hot-cache" in name)
                    store.bind(model)
                t0 = time.perf_counter()
                store.insert_cache(tokens, cache, source="batch")
                if "via its file" in name:  # another conversation's request came between
                    store.service.store.flush()
                insert_s.append(time.perf_counter() - t0)
                disk = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
                held = store.nbytes or disk  # what the budget counts: memory, else files
                del cache
                t0 = time.perf_counter()
                got, rest = store.fetch_nearest_cache(probe, allowed_sources={"batch"})
                _evaluated(got)
                fetch_s.append(time.perf_counter() - t0)
                assert len(probe) - len(rest) >= len(tokens) - 1, (len(rest), len(tokens))
                if name != "stock":
                    store.close()
        rows[name] = {"insert_ms": 1e3 * statistics.median(insert_s),
                      "fetch_ms": 1e3 * statistics.median(fetch_s),
                      "bytes_counted": held, "disk_bytes": disk,
                      "held_in_budget": budget // held if held else None}
    return {"prompt_tokens": len(tokens), "repeats": repeats, "budget_bytes": budget,
            "rows": rows}


def _vm_hwm(pid: int) -> int | None:
    from kvplugin.tools.bench.server_phases import read_memory

    return read_memory(pid)[1]


def conversation(model_dir: Path, kind: str, prompt_tokens: int, turns: int,
                 max_tokens: int, mode: str = "batched") -> dict:
    """One multi-turn conversation on a real server (``mode``: the host's default batched
    path, or ``single``: ``--disable-batching``); TTFT, reuse, answers, VmHWM."""
    from kvplugin.hostspecs import MLX_OPENAI_SERVER
    from kvplugin.tools import hostcmd
    from kvplugin.tools.bench.server_phases import model_pid
    from kvplugin.tools.client import stream_chat
    from kvplugin.tools.hostproc import ServerProcess
    from kvplugin.tools.prompts import TextMaker

    env = SERVER_KINDS[kind]
    port = hostcmd.free_port()
    with tempfile.TemporaryDirectory(prefix=f"oai-bench-{kind}-") as tmp:
        cmd = hostcmd.host_cmd(MLX_OPENAI_SERVER, model_dir, port, "--prompt-cache-dir",
                               str(Path(tmp) / "prompt-cache"),
                               *(["--disable-batching"] if mode == "single" else []))
        with ServerProcess(cmd, port=port, env=env, workdir=Path(tmp) / "srv",
                           model=hostcmd.SERVED_MODEL_NAME, startup_timeout=300) as srv:
            stream_chat(srv, [{"role": "user", "content": "Hello."}], max_tokens=2)
            pid = model_pid(srv.pid)
            hwm_start = _vm_hwm(pid)
            system = TextMaker(model_dir).text(prompt_tokens, seed="oai-conversation")
            messages = [{"role": "system", "content": system}]
            rows = []
            for i in range(turns):
                messages.append({"role": "user", "content": f"Question {i + 1}: what next?"})
                reply = stream_chat(srv, messages, max_tokens=max_tokens)
                rows.append({"ttft_ms": 1e3 * (reply.ttft_s or 0), "text": reply.text,
                             "prompt_tokens": reply.prompt_tokens,
                             "cached_tokens": reply.cached_tokens})
                messages.append({"role": "assistant", "content": reply.text})
            time.sleep(0.5)  # the last entry stored
            hwm_end = _vm_hwm(pid)
    warm = [r["ttft_ms"] for r in rows[1:]]
    return {"turns": rows, "cold_ttft_ms": rows[0]["ttft_ms"],
            "warm_ttft_ms": statistics.median(warm) if warm else None,
            "cached_tokens": sum(r["cached_tokens"] or 0 for r in rows),
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in rows),
            "vm_hwm_start": hwm_start, "vm_hwm_end": hwm_end,
            "vm_hwm_growth": None if None in (hwm_start, hwm_end) else hwm_end - hwm_start}


def _model_dir(name: str) -> Path:
    if name == "tiny":
        from kvplugin.tools.launch import prepare_model

        return prepare_model(None, progress=False)
    from kvplugin.tools.bench.memory import resolve_model

    return resolve_model(name)


def report(name: str, result: dict) -> str:
    s, c = result["store"], result["servers"]
    lines = [f"{name}: entry of {s['prompt_tokens']} tokens (median of {s['repeats']}); "
             f"budget {s['budget_bytes'] / MIB:.0f} MiB",
             f"  {'':32} {'insert (request thread)':>24} {'fetch':>10} {'counted':>11} "
             f"{'on disk':>11} {'held':>5}"]
    for row_name, r in s["rows"].items():
        lines.append(f"  {row_name:32} {r['insert_ms']:>21.1f} ms {r['fetch_ms']:>7.1f} ms "
                     f"{r['bytes_counted'] / MIB:>7.2f} MiB {r['disk_bytes'] / MIB:>7.2f} MiB "
                     f"{r['held_in_budget']:>5}")
    if not c:
        return "\n".join(lines)
    stock = c["stock"]
    lines.append(f"  server ({result['mode']}), {len(stock['turns'])} turns: {'':4} {'cold TTFT':>10} "
                 f"{'warm TTFT':>10} {'reused':>14} {'VmHWM growth':>13} same answers")
    for kind, r in c.items():
        same = sum(a["text"] == b["text"] for a, b in zip(r["turns"], stock["turns"]))
        growth = r["vm_hwm_growth"]
        lines.append(f"  {kind:24} {r['cold_ttft_ms']:>7.0f} ms {r['warm_ttft_ms']:>7.0f} ms "
                     f"{r['cached_tokens']:>5} of {r['prompt_tokens']:<5} "
                     f"{'-' if growth is None else f'{growth / MIB:.1f} MiB':>13} "
                     f"{same}/{len(r['turns'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvplugin.tools.bench.oai", description=__doc__)
    p.add_argument("--model", action="append", default=None, help="tiny, smollm2, kv-heavy or a dir")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-mib", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--mode", choices=("batched", "single"), default="batched",
                   help="the servers' path: batched (the host's default) or single "
                        "(--disable-batching)")
    p.add_argument("--no-servers", action="store_true",
                   help="the in-process entry costs only (no real servers)")
    p.add_argument("--servers", default=",".join(SERVER_KINDS),
                   help="which servers, comma separated (default: all; stock always runs)")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args(argv)
    unknown = set(args.servers.split(",")) - set(SERVER_KINDS)
    if unknown:
        p.error(f"--servers: unknown {sorted(unknown)}; known: {', '.join(SERVER_KINDS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    everything = {}
    for name in args.model or ["tiny", "smollm2"]:
        model_dir = _model_dir(name)
        result = {"mode": args.mode, "store": store_costs(model_dir, args.prompt_tokens, args.repeats,
                                       args.budget_mib * MIB),
                  "servers": {} if args.no_servers else {
                      kind: conversation(model_dir, kind, args.prompt_tokens, args.turns,
                                         args.max_tokens, args.mode)
                      for kind in dict.fromkeys(["stock", *args.servers.split(",")])}}
        print(report(name, result), flush=True)
        everything[name] = result
    (args.out / "oai.json").write_text(json.dumps(everything, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
