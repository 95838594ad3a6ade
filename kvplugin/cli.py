"""``kvplugin`` command line: ``info``, ``demo`` and ``bench``.

``kvplugin bench`` forwards its arguments to one benchmark: the engine level by default
(:func:`kvplugin.tools.bench.engine.main`), ``--server`` for real host processes
(:func:`kvplugin.tools.bench.server.main`), ``--quality`` for quantized-KV quality
(:func:`kvplugin.tools.bench.quality.main`). ``kvplugin bench [--server|--quality] --help`` shows
that benchmark's options.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import kvplugin
from kvplugin.options import add_options, given_flags
from kvplugin.settings import SettingsError


def cmd_info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import json

    from kvplugin import info

    try:
        data = info.collect(given_flags(parser, args), server=args.server)
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # --server: unreachable, or not kvplugin's stats
        print(f"kvplugin: --server {args.server}: cannot read its /kvplugin/stats ({exc})",
              file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2) if args.json else info.render(data))
    return 0


def cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvplugin.tools import demo

    return demo.run(args)


BENCH_MODES = {
    "engine": ("kvplugin.tools.bench.engine", "engine level: synthetic caches, stock vs kvplugin"),
    "server": ("kvplugin.tools.bench.server", "server level: real host processes, stock vs kvplugin"),
    "quality": ("kvplugin.tools.bench.quality", "answer quality with quantized KV entries"),
    "hybrid": ("kvplugin.tools.bench.state_quality",
               "with --quality: the recurrent-state codec on a trained tiny hybrid model"),
    "memory": ("kvplugin.tools.bench.memory",
               "with --server: the whole process's memory across cache reuse (VmHWM, MLX)"),
    "bound": ("kvplugin.tools.bench.bound",
              "a real model's decode inside a --max-kv-size bound: speed and memory vs stock"),
    "families": ("kvplugin.tools.bench.families",
                 "with --server: per model family, stock vs kvplugin reuse, bytes, warm TTFT"),
    "remote": ("kvplugin.tools.bench.remote",
               "with --server: replicas sharing a real redis-server: warm TTFT from the remote "
               "tier vs a cold prefill, bytes per hit, the cost of a miss"),
    "pressure": ("kvplugin.tools.bench.pressure",
                 "stock vs --kv-cache-quantization-policy always vs pressure on real servers: "
                 "warm TTFT with room to spare, conversations kept and peaks under pressure"),
}


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import importlib

    if (args.memory or args.families) and args.quality:
        parser.error("--memory and --families go with --server, not --quality")
    if (args.memory or args.families or args.remote) and args.quality:
        parser.error("--remote goes with --server, not --quality")
    if sum((args.memory, args.families, args.remote)) > 1:
        parser.error("--memory, --families and --remote are separate benchmarks: choose one")
    mode = ("pressure" if args.pressure else "memory" if args.memory
            else "families" if args.families
            else "remote" if args.remote
            else "server" if args.server
            else "quality" if args.quality
            else "bound" if args.bound else "engine")
    rest = list(args.bench_args)
    if mode == "quality" and "--hybrid" in rest:  # its own options
        mode = "hybrid"
    module_name, _ = BENCH_MODES[mode]
    if args.help:
        if mode == "engine":  # the overview first: how to reach the other benchmarks
            print(parser.format_help())
            print("engine-level options (the default benchmark):\n")
        rest = ["--help"]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"kvplugin bench: the {mode} benchmark is not part of this kvplugin build "
                  f"({module_name} is missing)", file=sys.stderr)
            return 2
        raise
    return int(module.main(rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplugin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=kvplugin.__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="version, hosts, plugins and resolved settings",
                          description="Whether kvplugin is active here (and why not), hosts, "
                                      "plugins, the configuration file and the resolved "
                                      "settings with their sources (flag > env > file > "
                                      "default).")
    add_options(info)
    info.add_argument("--json", action="store_true", help="the same facts as JSON")
    info.add_argument("--server", metavar="URL", help="also what the kvplugin server at URL "
                      "kept out of its tiers and store, counted by reason")
    info.set_defaults(func=cmd_info, subparser=info)

    from kvplugin.tools import demo

    demo_parser = demo.build_parser()
    dp = sub.add_parser("demo", help="start a host on a tiny local model and show kvplugin at "
                        "work (offline)", description=demo_parser.description,
                        epilog=demo_parser.epilog, parents=[demo_parser], add_help=False)
    dp.set_defaults(func=cmd_demo, subparser=dp)

    bench = sub.add_parser(
        "bench", add_help=False, help="stock vs kvplugin benchmarks (engine, --server, --quality)",
        usage="kvplugin bench [--server [--memory] | --quality] [-h] [OPTIONS...]",
        description="Stock vs kvplugin in one run. Without a mode: the engine-level benchmark. "
                    "Every other option goes to the chosen benchmark; "
                    "`kvplugin bench [--server|--quality] --help` lists them.",
    )
    mode = bench.add_mutually_exclusive_group()
    mode.add_argument("--server", action="store_true", help=BENCH_MODES["server"][1])
    mode.add_argument("--quality", action="store_true", help=BENCH_MODES["quality"][1])
    mode.add_argument("--bound", action="store_true", help=BENCH_MODES["bound"][1])
    mode.add_argument("--pressure", action="store_true", help=BENCH_MODES["pressure"][1])
    bench.add_argument("--memory", action="store_true", help=BENCH_MODES["memory"][1])
    bench.add_argument("--families", action="store_true", help=BENCH_MODES["families"][1])
    bench.add_argument("--remote", action="store_true", help=BENCH_MODES["remote"][1])
    bench.add_argument("-h", "--help", action="store_true",
                       help="show the chosen benchmark's options and exit")
    bench.set_defaults(func=cmd_bench, subparser=bench, bench_args=[])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:
        if args.command != "bench":
            args.subparser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.bench_args = rest
    try:
        code = args.func(args, args.subparser)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        return _closed_pipe()
    return code


def _closed_pipe() -> int:
    """``kvplugin info | head``: the reader left, which is not an error worth a traceback.

    Python's own advice: point stdout at devnull so the interpreter's final flush cannot
    fail again, and exit like a process killed by SIGPIPE would be reported by a shell.
    """
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13  # SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
