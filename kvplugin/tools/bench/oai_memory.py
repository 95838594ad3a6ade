"""``python -m kvplugin.tools.bench.oai_memory``: where mlx-openai-server's model process
reaches its memory peak, stock beside kvplugin (fp16 and 8-bit entries).

Why its own bench: a single ``VmHWM`` at the end says *that* a peak is higher, not *when*.
This reads the model process's ``VmRSS`` and ``VmHWM`` at each stage (ready, after a first
request, after each round of cold or reused turns) with the bytes kvplugin's store holds,
so an excess can be put down to start-up (imports, the admission probe), to a cold prefill
or to entries held in memory that stock holds on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
KINDS = {"stock": {"KVPLUGIN_DISABLE": "1"}, "fp16": {},
         "8bit": {"KVPLUGIN_KV_CACHE_QUANTIZATION": "1",
                  "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS": "8",
                  "KVPLUGIN_KV_CACHE_MIN_QUANTIZE_TOKENS": "64"},
         "memory": {"KVPLUGIN_HOT_CACHE_ONLY": "1"}}


def stages(model_dir: Path, kind: str, extra_env: dict[str, str], *, conversations: int,
           turns: int, prefix: int, max_tokens: int) -> dict[str, dict[str, Any]]:
    """One server's stages: ``{stage: {rss_mib, hwm_mib, store_bytes}}``."""
    from kvplugin.hostspecs import MLX_OPENAI_SERVER
    from kvplugin.tools import hostcmd
    from kvplugin.tools.bench.server_phases import _msg, _system, model_pid, read_memory
    from kvplugin.tools.client import get_stats, timed_chat
    from kvplugin.tools.hostproc import ServerProcess
    from kvplugin.tools.prompts import TextMaker

    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVPLUGIN_")}
    env.update(KINDS[kind])
    if kind != "stock":
        env.update(extra_env)
    port = hostcmd.free_port()
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix=f"oai-memory-{kind}-") as tmp:
        cmd = hostcmd.host_cmd(MLX_OPENAI_SERVER, model_dir, port)
        with ServerProcess(cmd, port=port, env=env, workdir=Path(tmp) / "srv",
                           model=hostcmd.SERVED_MODEL_NAME, startup_timeout=300) as srv:
            pid = model_pid(srv.pid)

            def mark(stage: str) -> None:
                rss, hwm = read_memory(pid)
                stats = get_stats(srv) or {}
                out[stage] = {"rss_mib": round((rss or 0) / MIB, 1),
                              "hwm_mib": round((hwm or 0) / MIB, 1),
                              "store_bytes": stats.get("store_bytes"),
                              "file_bytes": stats.get("cold_disk_bytes")}
                print(f"{kind:6} {stage:8} {out[stage]}", flush=True)

            mark("ready")
            timed_chat(srv, [_msg("user", "Hello.")], max_tokens=2)
            mark("hello")
            maker = TextMaker(model_dir)
            convs = [[_msg("system", _system(maker, prefix, ("memory", c)))]
                     for c in range(conversations)]
            for t in range(turns):
                for c, conv in enumerate(convs):
                    conv.append(_msg("user", f"Visitor {c}, turn {t}: what next?"))
                    reply = timed_chat(srv, conv, max_tokens=max_tokens)
                    conv.append(_msg("assistant", reply.text))
                time.sleep(0.3)  # the round's last entry stored
                mark(f"turn {t + 1}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvplugin.tools.bench.oai_memory",
                                description=__doc__)
    p.add_argument("--model", default="tiny", help="tiny, smollm2, kv-heavy or a dir")
    p.add_argument("--kinds", default="stock,fp16,8bit")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--env", action="append", default=[], metavar="KVPLUGIN_X=V",
                   help="extra variables for the kvplugin servers (e.g. KVPLUGIN_MAX_MEMORY=off)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvplugin.tools.bench.oai import _model_dir

    model_dir = _model_dir(args.model)
    extra = dict(item.split("=", 1) for item in args.env)
    result = {kind: stages(model_dir, kind, extra, conversations=args.conversations,
                           turns=args.turns, prefix=args.prefix_tokens,
                           max_tokens=args.max_tokens)
              for kind in args.kinds.split(",")}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
