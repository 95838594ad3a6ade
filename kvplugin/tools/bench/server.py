"""Server-level benchmark: the stock host vs the kvplugin host, real processes, tiny model.

``kvplugin bench --server`` / ``python -m kvplugin.tools.bench.server``. Starts the host twice on
the tiny local model (:mod:`kvplugin.tools.models.tiny`) with the same command line: once with
``KVPLUGIN_DISABLE=1`` (stock) and once with kvplugin's settings given as ``KVPLUGIN_*``
variables (quantized entries, ``--kv-bits`` bits by default 8), and drives the same
workload through the OpenAI API of both:

1. **time to first token**, cold (a prefix the server has not seen) vs warm (the next turn
   of the same conversation), at each ``--sizes`` prefix length, measured two ways: the first
   streamed token, and a whole non-streamed request with ``max_tokens=1``;
2. **memory across reuse**: ``--conversations`` conversations with long system prompts,
   ``--turns`` turns each, round robin (every turn reuses the conversation's cached prefix);
   the server's resident memory (``VmRSS``/``VmHWM`` of its process, sampled every 20 ms
   from ``/proc``; ``ps`` elsewhere) and kvplugin's own stats bytes;
3. **conversations held** in a fixed prompt-cache budget (``--fit-budget``; a fresh server of
   each kind): the largest ``n`` such that, after ``n`` new conversations, the first one's
   next turn still hits the cache (binary search, fresh conversations for every probe);
   stored bytes per conversation follow (budget / held; kvplugin's entries also directly);
4. **decode throughput** with kvplugin on vs off: ``--decode-rounds`` rounds, each one new
   short prompt streamed with ``--decode-tokens`` tokens to both servers back to back (both
   running, one request at a time, ABBA order). The goal is judged on the median over rounds
   of the servers' own CPU time (stock / kvplugin, from ``/proc/<pid>/stat``), which other
   jobs on a shared machine disturb least; wall-clock rates are reported next to it.

Output: a terminal table of ratios with the goals marked met/missed, ``server.json``
and PNG plots (matplotlib, if installed) in ``--out``. Timings on a shared CPU are noisy:
the JSON keeps every sample.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from kvplugin.tools import hostcmd
from kvplugin.tools.bench.report import Goal, Progress, environment, goals_table, save_results
from kvplugin.tools.bench.server_phases import (
    RssSampler,
    model_pid,
    phase_decode,
    phase_fit,
    phase_memory,
    phase_ttft,
    read_memory,
    warm_up,
)
from kvplugin.tools.bench.server_report import GOALS, goals, make_plots, ratios, tables
from kvplugin.tools.client import get_stats
from kvplugin.tools.console import Status, cleanup_signals, parse_size, stop_quietly
from kvplugin.tools.hostcmd import HostNotInstalled
from kvplugin.tools.hostproc import ServerProcess, ServerStartError
from kvplugin.tools.launch import HOSTS, DemoFailed, HostSpec, host_spec, prepare_model
from kvplugin.tools.prompts import TextMaker

__all__ = ["main", "build_parser", "run", "GOALS", "RssSampler"]

MiB = 1 << 20


DEFAULTS = dict(sizes=[1024, 2048], repeats=3, conversations=4, turns=6, mem_prefix=2048,
                mem_tokens=32, fit_budget=8 * MiB, fit_prefix=512, fit_max=32,
                decode_rounds=20, decode_tokens=128, decode_prompt=64)
QUICK = dict(sizes=[256, 512], repeats=1, conversations=2, turns=3, mem_prefix=512,
             mem_tokens=8, fit_budget=1 * MiB, fit_prefix=256, fit_max=12,
             decode_rounds=2, decode_tokens=64, decode_prompt=64)




# =============================================================================================
# the run


def _server_env(kind: str, bits: int | None) -> dict[str, str | None]:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVPLUGIN_")}
    if kind == "stock":
        env["KVPLUGIN_DISABLE"] = "1"
    elif bits is not None:
        env.update({"KVPLUGIN_KV_CACHE_QUANTIZATION": "1",
                    "KVPLUGIN_KV_CACHE_QUANTIZATION_BITS": str(bits),
                    "KVPLUGIN_KV_CACHE_MIN_QUANTIZE_TOKENS": "64"})
    return env


class _Servers:
    """Starts servers, remembers them, stops them all (also on Ctrl-C)."""

    def __init__(self, spec: HostSpec, model_dir: Path, host_args: Sequence[str], bits: int | None,
                 progress: bool, startup_timeout: float):
        self.spec, self.model_dir, self.host_args = spec, model_dir, list(host_args)
        self.bits, self.progress, self.startup_timeout = bits, progress, startup_timeout
        self.live: list[ServerProcess] = []
        self.failed: list[ServerProcess] = []

    def start(self, kind: str, extra: Sequence[str] = ()) -> ServerProcess:
        port = hostcmd.free_port()
        args = [*extra, *self.host_args]
        env = {**self.spec.env, **_server_env(kind, self.bits)}
        srv = ServerProcess(self.spec.command(self.model_dir, port, args), port=port, env=env,
                            model=self.spec.model, startup_timeout=self.startup_timeout,
                            workdir=tempfile.mkdtemp(prefix=f"kvplugin-bench-{kind}-"),
                            name=f"{self.spec.label} ({kind})")
        self.live.append(srv)
        try:
            with Status(f"starting {kind} {self.spec.label}", enabled=self.progress):
                srv.start()
        except ServerStartError as err:
            self.failed.append(srv)
            raise DemoFailed(f"the {kind} server did not start:\n{err}") from None
        stats = get_stats(srv)
        if kind == "stock" and stats is not None:
            self.failed.append(srv)
            raise DemoFailed("the stock server answers GET /kvplugin/stats: KVPLUGIN_DISABLE=1 "
                             "did not switch kvplugin off")
        if kind == "kvplugin" and stats is None:
            self.failed.append(srv)
            raise DemoFailed(
                f"kvplugin is not active in the kvplugin server (GET /kvplugin/stats does not "
                f"answer); its log: {srv.log_path}\n{srv.log_tail(20)}")
        return srv

    def stop(self, srv: ServerProcess) -> None:
        stop_quietly([srv])
        if srv not in self.failed:  # a failed server's log is kept (and named)
            shutil.rmtree(srv.workdir, ignore_errors=True)
        with contextlib.suppress(ValueError):
            self.live.remove(srv)

    def stop_all(self) -> None:
        stop_quietly(self.live)
        for srv in list(self.live):
            self.stop(srv)
        for srv in self.failed:
            if srv.log_path.exists():
                print(f"kvplugin bench: the log of {srv.name} is kept in {srv.log_path}",
                      file=sys.stderr)


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = host_spec(args.host)
    version = spec.check()
    model_dir = prepare_model(args.model_dir, progress=args.progress)
    maker = TextMaker(model_dir)
    bits = None if args.no_quantization else args.kv_bits
    res: dict[str, Any] = {
        "benchmark": "server",
        "config": {
            "host": spec.name, "host_version": version, "quick": args.quick,
            "sizes": args.sizes, "repeats": args.repeats, "conversations": args.conversations,
            "turns": args.turns, "mem_prefix": args.mem_prefix, "mem_tokens": args.mem_tokens,
            "fit_budget": args.fit_budget, "fit_prefix": args.fit_prefix, "fit_max": args.fit_max,
            "decode_rounds": args.decode_rounds, "decode_tokens": args.decode_tokens,
            "decode_prompt": args.decode_prompt, "kv_bits": bits,
            "host_args": list(args.host_args),
            "kvplugin_env": {k: v for k, v in _server_env("kvplugin", bits).items() if v},
            "stock_env": {"KVPLUGIN_DISABLE": "1"},
            "model": "kvplugin tiny model v1 (llama, 2 layers, 2 KV heads x 64, fp16: "
                     "1 KiB of KV per token)",
        },
        "environment": environment(),
        "goal_limits": GOALS,
        "stock": {}, "kvplugin": {},
    }
    t_run = time.perf_counter()
    servers = _Servers(spec, model_dir, args.host_args, bits, args.progress, args.startup_timeout)
    kinds = ("stock", "kvplugin")
    live: dict[str, ServerProcess] = {}
    samplers: dict[str, RssSampler] = {}
    try:
        main_args = spec.budget_args(args.main_budget)
        try:
            for kind in kinds:  # one after the other; both stay up for the interleaved decode
                live[kind] = servers.start(kind, main_args)
                samplers[kind] = RssSampler(model_pid(live[kind].pid)).start()
            per_server = 3 + 4 * len(args.sizes) * args.repeats + args.conversations * args.turns
            for kind in kinds:
                srv = live[kind]
                with Progress(per_server, f"{kind}: ttft, memory", enabled=args.progress) as bar:
                    warm_up(srv, maker, max(args.sizes))
                    bar.update(3)
                    res[kind]["startup_s"] = srv.startup_seconds
                    res[kind]["ttft"] = phase_ttft(srv, maker, args.sizes, args.repeats, bar)
                    res[kind]["memory"] = phase_memory(
                        srv, maker, samplers[kind], kvplugin=kind == "kvplugin",
                        conversations=args.conversations, turns=args.turns,
                        prefix=args.mem_prefix, max_tokens=args.mem_tokens, bar=bar)
            with Progress(2 * args.decode_rounds, "decode (interleaved)",
                          enabled=args.progress) as bar:
                decode = phase_decode(live, maker, rounds=args.decode_rounds,
                                      tokens=args.decode_tokens, prompt=args.decode_prompt, bar=bar)
            for kind in kinds:
                res[kind]["decode"] = decode[kind]
            res["decode_paired"] = decode.get("paired")
            stats = get_stats(live["kvplugin"]) or {}
            res["kvplugin"]["stats"] = {k: v for k, v in stats.items() if k != "entries"}
            res["kvplugin"]["entries_sample"] = (stats.get("entries") or [])[-4:]
            for kind in kinds:
                _, hwm = read_memory(samplers[kind].pid)
                res[kind]["vm_hwm"] = hwm
        finally:
            for s in samplers.values():
                s.stop()
            for kind in kinds:
                if kind in live:
                    servers.stop(live[kind])
        for kind in kinds:
            srv = servers.start(kind, spec.budget_args(args.fit_budget))
            steps = max(1, math.ceil(math.log2(args.fit_max + 1))) * (args.fit_max // 2 + 2)
            with Progress(steps, f"{kind}: conversations in budget",
                          enabled=args.progress) as bar:
                res[kind]["fit"] = phase_fit(srv, maker, budget=args.fit_budget,
                                             prefix=args.fit_prefix, max_n=args.fit_max,
                                             kvplugin=kind == "kvplugin", bar=bar)
            servers.stop(srv)
    finally:
        servers.stop_all()
    res["elapsed_s"] = time.perf_counter() - t_run
    res["ratios"] = ratios(res)
    res["goals"] = [g.to_dict() for g in goals(res)]
    return res


# =============================================================================================
# command line


def _sizes(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of token counts: {text!r}") from None
    if not out or any(n < 32 for n in out):
        raise argparse.ArgumentTypeError("prefix sizes must be >= 32 tokens")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvplugin bench --server",
        description="Server-level benchmark: the stock host (KVPLUGIN_DISABLE=1) vs the "
                    "kvplugin host, real processes on the tiny local model: warm vs cold "
                    "time to first token, memory across reuse, conversations held in a "
                    "budget, decode throughput.",
        epilog="Extra host arguments (given to both servers) go after `--`.",
    )
    p.add_argument("--host", choices=HOSTS, default="mlx-lm", help="default: mlx-lm")
    p.add_argument("--kv-bits", type=int, choices=range(2, 9), default=8, metavar="{2..8}",
                   help="kvplugin's --kv-cache-quantization-bits (default 8)")
    p.add_argument("--no-quantization", action="store_true",
                   help="kvplugin stores fp16 entries (trimmed only)")
    p.add_argument("--sizes", type=_sizes, default=None,
                   help="prefix lengths for time to first token, comma separated "
                        f"(default {','.join(map(str, DEFAULTS['sizes']))})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"cold/warm pairs per size (default {DEFAULTS['repeats']})")
    p.add_argument("--conversations", type=int, default=None,
                   help=f"conversations in the memory phase (default {DEFAULTS['conversations']})")
    p.add_argument("--turns", type=int, default=None,
                   help=f"turns per conversation in the memory phase (default {DEFAULTS['turns']})")
    p.add_argument("--mem-prefix", type=int, default=None,
                   help="system prompt tokens in the memory phase "
                        f"(default {DEFAULTS['mem_prefix']})")
    p.add_argument("--mem-tokens", type=int, default=None,
                   help=f"tokens generated per turn in the memory phase "
                        f"(default {DEFAULTS['mem_tokens']})")
    p.add_argument("--fit-budget", type=parse_size, default=None, metavar="SIZE",
                   help="prompt-cache budget of the conversations-held phase (default 8M = "
                        "8 MiB; K/M/G are binary)")
    p.add_argument("--fit-prefix", type=int, default=None,
                   help="system prompt tokens per conversation there "
                        f"(default {DEFAULTS['fit_prefix']})")
    p.add_argument("--fit-max", type=int, default=None,
                   help=f"most conversations tried (default {DEFAULTS['fit_max']})")
    p.add_argument("--decode-rounds", type=int, default=None,
                   help=f"decode requests per server (default {DEFAULTS['decode_rounds']})")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help=f"max_tokens of each decode request (default {DEFAULTS['decode_tokens']})")
    p.add_argument("--decode-prompt", type=int, default=None,
                   help="prompt tokens of each decode request "
                        f"(default {DEFAULTS['decode_prompt']})")
    p.add_argument("--main-budget", type=parse_size, default=1 << 30, metavar="SIZE",
                   help="prompt-cache budget of the TTFT/memory/decode servers (default 1G: "
                        "nothing is evicted there)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="the tiny model (built there if missing; default as `kvplugin demo`)")
    p.add_argument("--startup-timeout", type=float, default=180.0, metavar="S")
    p.add_argument("--out", type=Path, default=Path("kvplugin-bench"),
                   help="directory for server.json and the PNG plots (default ./kvplugin-bench)")
    p.add_argument("--quick", action="store_true", help="small sizes (about a minute; the tests)")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("host_args", nargs="*", metavar="-- HOST_ARGS",
                   help="extra arguments for both host servers, after `--`")
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    base = QUICK if args.quick else DEFAULTS
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, list(v) if isinstance(v, list) else v)
    for k in ("repeats", "conversations", "turns", "fit_max", "decode_rounds", "decode_tokens"):
        if getattr(args, k) < 1:
            raise SystemExit(f"kvplugin bench --server: --{k.replace('_', '-')} must be >= 1")
    if args.decode_tokens < 2:
        raise SystemExit("kvplugin bench --server: --decode-tokens must be >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _resolve(build_parser().parse_args(argv))
    with cleanup_signals():
        try:
            res = run(args)
        except KeyboardInterrupt:
            print("\nkvplugin bench: interrupted; every server was stopped.", file=sys.stderr)
            return 130
        except (DemoFailed, HostNotInstalled) as err:
            print(f"kvplugin bench: {err}", file=sys.stderr)
            return 1
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    res["plots"] = make_plots(res, out) if args.plots else {}
    cfg, env = res["config"], res["environment"]
    print(f"kvplugin server bench - {cfg['host']} {cfg['host_version']}, tiny model, "
          f"kvplugin entries {cfg['kv_bits'] or 16}-bit, device {env.get('mlx_device', '?')} "
          f"({env.get('cpu_count')} CPUs), {res['elapsed_s']:.0f} s\n")
    print(tables(res))
    print()
    print(goals_table([Goal(**{k: v for k, v in g.items() if k not in ("verdict", "met")})
                       for g in res["goals"]], "Goals (server level)"))
    save_results(out / "server.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
