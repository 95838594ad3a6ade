"""``kvplugin bench --server --memory``: a real server's memory across cache reuse.

The promise kvplugin makes is about the *whole process*: a server reusing a long
conversation must not reach a higher high-water mark than stock. So this bench runs the
same conversation on a stock server and on kvplugin servers (fp16, 8-bit, 4-bit entries),
each under :mod:`kvplugin.tools.memtrace`, and reports for each:

- ``VmHWM`` growth from just before the first turn to the end, as x the entry
  (the entry = the bytes of the cache the first turn's prompt fills, read from the
  model's own cache classes: :func:`entry_bytes`);
- the same from just before the first *reuse* turn (what reuse itself costs);
- MLX's peak during the conversation above its active memory just before the first turn,
  x the entry (the arrays alive at the worst moment, the entries held included);
- the largest MLX transient of a reuse turn (peak during the turn minus the active memory
  before it), x the entry;
- MLX active memory after the last turn (what stays held);
- warm time-to-first-token and decode tokens/s of the reuse turns (streamed requests);
- prompt tokens reused of the prompt tokens sent, and how many answers were stock's.

Why the last column: the next turn's prompt holds the last answer, so a server whose answer
differs (a quantized entry may change one) is asked other prompts from then on, and its
tokens reused and times compare with stock's only roughly. The table says so where it
happens instead of leaving a lower count to look like lost reuse.

Every figure is labelled with the server that produced it; the stock row is always printed.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

MiB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """One server of the comparison: a label, kvplugin's flags, and whether kvplugin runs."""

    label: str
    args: tuple[str, ...] = ()
    stock: bool = False


CONFIGS: dict[str, ServerConfig] = {
    "stock": ServerConfig("stock", stock=True),
    "fp16": ServerConfig("kvplugin fp16"),
    "8bit": ServerConfig(
        "kvplugin 8-bit", ("--kv-cache-quantization", "--kv-cache-quantization-bits", "8")
    ),
    "4bit": ServerConfig(
        "kvplugin 4-bit", ("--kv-cache-quantization", "--kv-cache-quantization-bits", "4")
    ),
}


@dataclass
class TurnResult:
    start: float
    end: float
    prompt_tokens: int
    cached_tokens: int | None
    ttft_s: float
    decode_tok_s: float | None
    text: str


@dataclass
class RunResult:
    config: str
    label: str
    entry_bytes: int
    turns: list[TurnResult] = field(default_factory=list)
    trace: list[dict[str, Any]] = field(default_factory=list)
    host_tokens_saved: int | None = None  # the host's own count, where usage has none

    def _at(self, t: float) -> dict[str, Any]:
        before = [x for x in self.trace if x["t"] <= t]
        return before[-1] if before else self.trace[0]

    def summary(self) -> dict[str, Any]:
        entry = self.entry_bytes
        end = self.trace[-1]
        first, reuse = self._at(self.turns[0].start), self._at(self.turns[1].start)
        transients = []
        for turn in self.turns[1:]:
            inside = [x for x in self.trace if turn.start <= x["t"] <= turn.end + 0.2]
            if inside:
                peak = max(x["peak"] for x in inside)
                transients.append((peak - self._at(turn.start)["active"]) / entry)
        warm = self.turns[1:]
        rates = [t.decode_tok_s for t in warm if t.decode_tok_s]
        # the whole process's MLX peak from the conversation's start: what it holds before it
        # counts too (kvplugin's imports and codec warm-up; stock's entries' slack)
        mlx_peak = max(x["peak"] for x in self.trace if x["t"] > first["t"])
        return {
            "server": self.label,
            "entry_mib": entry / MiB,
            "hwm_growth_x": (end["hwm"] - first["hwm"]) / entry,
            "hwm_growth_reuse_x": (end["hwm"] - reuse["hwm"]) / entry,
            "mlx_peak_growth_x": (mlx_peak - first["active"]) / entry,
            "max_reuse_transient_x": max(transients) if transients else None,
            "mlx_peak_mib": mlx_peak / MiB,
            "hwm_end_mib": end["hwm"] / MiB,
            "held_after_mib": end["active"] / MiB,
            "warm_ttft_ms": 1000 * sorted(t.ttft_s for t in warm)[len(warm) // 2],
            "cold_ttft_ms": 1000 * self.turns[0].ttft_s,
            "decode_tok_s": sorted(rates)[len(rates) // 2] if rates else None,
            "tokens_reused": self.tokens_reused(),
            "prompt_tokens": sum(t.prompt_tokens for t in self.turns),
        }

    def answers_as(self, other: "RunResult") -> int:
        """How many of this run's answers are ``other``'s, turn by turn (greedy requests:
        the same cache gives the same answer)."""
        return sum(a.text == b.text for a, b in zip(self.turns, other.turns))

    def tokens_reused(self) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens`` summed over the turns; where no turn
        reports it (vllm-mlx's chat completions never do), the host's own prefix-cache count
        (:func:`host_tokens_saved`), else None (unknown, not 0)."""
        if any(t.cached_tokens is not None for t in self.turns):
            return sum(t.cached_tokens or 0 for t in self.turns)
        return self.host_tokens_saved


def host_tokens_saved(server: Any) -> int | None:
    """vllm-mlx's ``GET /v1/status`` ``cache.tokens_saved`` (its prefix cache's count of prompt
    tokens served from cache; kvplugin's prefix cache reports the same field), or None."""
    try:
        status, body = server.request("GET", "/v1/status", timeout=30)
    except OSError:
        return None
    cache = body.get("cache") if status == 200 and isinstance(body, dict) else None
    saved = cache.get("tokens_saved") if isinstance(cache, dict) else None
    return int(saved) if isinstance(saved, (int, float)) else None


def _kvplugin_stats(server: Any) -> dict[str, Any] | None:
    """``GET /kvplugin/stats`` as a dict, or None where it is not served (stock)."""
    from kvplugin.tools.hostproc import ServerHTTPError

    try:
        stats = server.get("/kvplugin/stats")
    except (OSError, ValueError, ServerHTTPError):
        return None
    return stats if isinstance(stats, dict) else None


def wait_stored(server: Any, tokens: int, timeout: float = 30.0) -> None:
    """Wait until a kvplugin server holds an entry of at least ``tokens`` tokens (the last
    turn's prompt): a host stores a turn's entry after the answer's last token, and quantizing
    it takes a few hundred ms on a CPU, so a sample taken at once counts the live cache as
    held. Returns at once where ``/kvplugin/stats`` is not served (stock)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entries = (_kvplugin_stats(server) or {}).get("entries")
        if not isinstance(entries, list) or any(e.get("tokens", 0) >= tokens for e in entries):
            return
        time.sleep(0.05)


def stored_codec(server: Any) -> str | None:
    """The codecs a kvplugin server stored its quantized entries' layers with, as
    ``/kvplugin/stats`` counts their bytes (e.g. ``rotated-channel-k4v4-s4r16``; an entry with a
    window may take another codec or bits than a plain one: ``kvplugin.codecs``); else the
    codec its settings name; None when it quantizes nothing."""
    from kvplugin.codecs import PRE_ROPE, CodecPlan

    stats = _kvplugin_stats(server) or {}
    q = stats.get("quantization")
    if not isinstance(q, dict):
        return None
    # a key joins its layers' names with "+", each maybe ending in PRE_ROPE ("+prerope")
    layer_joint = re.compile(r"\+(?!" + re.escape(PRE_ROPE[1:]) + ")")
    layers = {name for key in stats.get("bytes_stored_by_codec") or {} if key != "full"
              for name in layer_joint.split(key)}
    return ", ".join(sorted(layers)) or CodecPlan(
        q["codec"], q["key_bits"], q["value_bits"], q["group_size"], q["sink_tokens"],
        q["recent_tokens"]).name


@lru_cache(maxsize=8)
def _footprint(model_dir: str) -> Any:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvplugin.cache.memory.footprint import probe_footprint

    model, _ = load(model_dir)
    return probe_footprint(model, make_prompt_cache(model), [1] * 4)


def entry_bytes(model_dir: Path, tokens: int) -> int:
    """The bytes of the cache a ``tokens``-token prompt fills in this model, read from the
    model's own cache classes (a few tokens through a fresh cache, as admission control
    probes it), not from ``config.json``: windows stop growing at their size, recurrent state
    is fixed, latent (MLA) caches hold what they hold. A config-derived figure crashed on
    state-space models (no attention heads) and was wrong for every non-plain family."""
    return sum(layer.at(tokens) for layer in _footprint(str(Path(model_dir).resolve())).layers)


def _turn(server: Any, messages: list[dict], max_tokens: int, seed: int | None) -> TurnResult:
    """One streamed greedy request through the shared client, as wall-clock marks."""
    from kvplugin.tools.client import stream_chat

    start = time.time()
    reply = stream_chat(server, messages, max_tokens=max_tokens, seed=seed)
    return TurnResult(start=start, end=start + reply.total_s,
                      prompt_tokens=int(reply.prompt_tokens or 0),
                      cached_tokens=reply.cached_tokens,
                      ttft_s=reply.ttft_s if reply.ttft_s is not None else reply.total_s,
                      decode_tok_s=reply.decode_tps, text=reply.text)


def run_one(
    model_dir: Path,
    config: ServerConfig,
    key: str,
    system_prompt: str,
    *,
    turns: int,
    max_tokens: int,
    prefill_step: int,
    workdir: Path,
    env: dict[str, str] | None = None,
    seed: int | None = None,
    host: str = "mlx-lm",
    host_args: Sequence[str] = (),
) -> RunResult:
    """Start one traced server, hold the conversation, stop it, read its trace."""
    from kvplugin.tools.hostcmd import free_port
    from kvplugin.tools.hostproc import ServerProcess

    port = free_port()
    trace_path = workdir / f"trace-{key}.jsonl"
    trace_path.unlink(missing_ok=True)
    from kvplugin.hostspecs import declaration

    host_decl = declaration(host)
    fill = {"model": str(model_dir), "host": "127.0.0.1", "port": str(port),
            "served_model_name": "bench"}
    launch = [part.format(**fill) for part in host_decl.launch]
    if host == "mlx-lm":
        launch += ["--prefill-step-size", str(prefill_step)]
    cmd = [
        sys.executable, "-m", "kvplugin.tools.memtrace", "--out", str(trace_path), "--",
        host_decl.console_script, *launch, *host_args, *config.args,
    ]
    server_env = {**host_decl.launch_env, **(env or {})}
    server_env["KVPLUGIN_DISABLE"] = "1" if config.stock else None  # type: ignore[assignment]
    result = RunResult(key, config.label, 0)
    model = "bench" if host_decl.request_needs_model else None
    with ServerProcess(cmd, port=port, env=server_env, workdir=workdir / key, model=model,
                       startup_timeout=300, name=key) as server:
        # Warm-up: a short unrelated request, so lazily loaded weights and the first graph are
        # in memory before the baseline is taken (then growth is the conversation's alone).
        _turn(server, [{"role": "user", "content": "Hello."}], 2, seed)
        saved_before = host_tokens_saved(server)
        time.sleep(0.1)
        messages = [{"role": "system", "content": system_prompt}]
        for i in range(turns):
            messages.append({"role": "user", "content": f"Question {i + 1}: what does the text say?"})
            turn = _turn(server, messages, max_tokens, seed)
            result.turns.append(turn)
            messages.append({"role": "assistant", "content": turn.text})
        if not config.stock and result.turns:  # "held after": after the last entry is stored
            wait_stored(server, result.turns[-1].prompt_tokens)
        codec = None if config.stock else stored_codec(server)
        if codec:  # the row says what produced it: --kv-cache-codec auto resolves by bits
            result.label = f"{config.label} ({codec})"  # and, at some, by the entry's layers
        saved_after = host_tokens_saved(server)
        if saved_before is not None and saved_after is not None:
            result.host_tokens_saved = saved_after - saved_before
        time.sleep(0.3)  # let the recorder take a last sample after the final insert
    result.entry_bytes = entry_bytes(model_dir, result.turns[0].prompt_tokens)
    result.trace = [json.loads(line) for line in trace_path.read_text().splitlines() if line]
    return result


def table(results: Sequence[RunResult], title: str) -> str:
    """The comparison; ``results[0]`` is stock (:func:`configs_to_run` puts it first)."""
    from kvplugin.tools.bench.report import format_table

    stock, rows, differed = results[0], [], []
    for r in results:
        s = r.summary()
        same = r.answers_as(stock)
        if r is not stock and same < len(r.turns):
            differed.append(r.label)
        rows.append([
            s["server"], f"{s['hwm_growth_x']:.2f}x", f"{s['hwm_growth_reuse_x']:.2f}x",
            f"{s['mlx_peak_growth_x']:.2f}x", f"{s['mlx_peak_mib']:.1f} MiB",
            f"{s['hwm_end_mib']:.0f} MiB",
            "-" if s["max_reuse_transient_x"] is None else f"{s['max_reuse_transient_x']:.2f}x",
            f"{s['held_after_mib']:.0f} MiB", f"{s['warm_ttft_ms']:.0f} ms",
            "-" if s["decode_tok_s"] is None else f"{s['decode_tok_s']:.1f}",
            ("-" if s["tokens_reused"] is None else f"{s['tokens_reused']}")
            + f" of {s['prompt_tokens']}",
            "-" if r is stock else f"{same}/{len(r.turns)}",
        ])
    text = format_table(
        ["server (measured in this run)", "VmHWM growth", "from 1st reuse", "MLX peak",
         "process MLX peak", "process VmHWM", "MLX transient", "MLX held after", "warm TTFT",
         "decode tok/s", "prompt tokens reused", "answers = stock's"],
        rows, title=title,
    )
    text += ("\nGrowth columns: x the entry, from just before the conversation. 'process'"
             " columns: the whole server, including what it held before the conversation"
             " (kvplugin's imports and codec warm-up; each server's entries from the warm-up"
             " request).")
    if differed:
        text += (f"\n{', '.join(differed)}: an answer differed from stock's, so the later turns'"
                 " prompts differed too; tokens reused and times compare only roughly there.")
    return text


def plot(results: Sequence[RunResult], path: Path, title: str) -> Path | None:
    """Memory over time, one panel per server, turns shaded and cache events marked."""
    from kvplugin.tools.bench.plots import _pyplot, _save

    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.6 * len(results)), sharex=False)
    axes = axes if len(results) > 1 else [axes]
    for ax, r in zip(axes, results):
        t0 = r.turns[0].start
        xs = [x["t"] - t0 for x in r.trace]
        ax.plot(xs, [x["hwm"] / MiB for x in r.trace], label="VmHWM", color="black", lw=1)
        ax.plot(xs, [x["rss"] / MiB for x in r.trace], label="VmRSS", color="grey", lw=0.8)
        ax.plot(xs, [x["active"] / MiB for x in r.trace], label="MLX active", color="tab:blue", lw=0.8)
        ax.scatter(xs, [x["peak"] / MiB for x in r.trace], label="MLX peak between samples",
                   color="tab:orange", s=1, alpha=0.5)
        for turn in r.turns:
            ax.axvspan(turn.start - t0, turn.end - t0, color="tab:green", alpha=0.08)
        for x in r.trace:
            if x["kind"] == "event" and x["name"] not in ("start", "exit"):
                ax.axvline(x["t"] - t0, color="tab:red", lw=0.4, alpha=0.6)
        ax.set_title(f"{r.label}: entry {r.entry_bytes / MiB:.0f} MiB", fontsize=9)
        ax.set_ylabel("MiB")
        ax.set_xlim(left=-1)
    axes[0].legend(fontsize=7, loc="upper left")
    axes[-1].set_xlabel("seconds from the first request (green: requests, red: kvplugin cache events)")
    fig.suptitle(title, fontsize=10)
    return _save(fig, plt, path)


def results_json(results: Sequence[RunResult]) -> dict[str, Any]:
    return {
        r.config: {
            "summary": {**r.summary(), "answers_as_stock": r.answers_as(results[0])},
            "turns": [asdict(t) for t in r.turns],
        }
        for r in results
    }


def resolve_model(name: str) -> Path:
    """``kv-heavy``, ``smollm2`` or a model directory."""
    if name == "kv-heavy":
        from kvplugin.tools.models.kv_heavy import build_kv_heavy_model

        return build_kv_heavy_model()
    if name == "smollm2":
        from kvplugin.tools.models.smollm2 import build_smollm2

        return build_smollm2()
    return Path(name).expanduser().resolve()


def configs_to_run(text: str) -> list[str]:
    """``--configs`` as the servers to run, stock first even when not named: every kvplugin
    figure is read beside stock's from the same run. ``ValueError`` names an unknown one."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown --configs {', '.join(unknown)}; from {', '.join(CONFIGS)}")
    return ["stock"] + [k for k in dict.fromkeys(keys) if k != "stock"]


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os
    import tempfile

    from kvplugin.tools.prompts import TextMaker

    p = argparse.ArgumentParser(prog="kvplugin bench --server --memory", description=__doc__)
    p.add_argument("--model", action="append", default=None,
                   help="kv-heavy (default), smollm2, or a model directory; repeatable")
    p.add_argument("--configs", default="stock,fp16,8bit,4bit",
                   help=f"comma-separated, from {', '.join(CONFIGS)} (stock always runs)")
    p.add_argument("--prompt-tokens", type=int, default=5456)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prefill-step-size", type=int, default=256)
    p.add_argument("--host", default="mlx-lm", choices=["mlx-lm", "vllm-mlx"],
                   help="which host server to measure")
    p.add_argument("--continuous-batching", action="store_true",
                   help="vllm-mlx: its continuous-batching mode (default: its simple mode)")
    p.add_argument("--sequential", action="store_true",
                   help="send a seed with every request: mlx-lm's sequential path")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args(argv)
    try:
        configs = configs_to_run(args.configs)
    except ValueError as err:
        p.error(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    env = {}
    blas = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
    if sys.platform == "linux" and os.path.exists(blas):
        env["LD_PRELOAD"] = blas  # same answers, ~40x faster fp32 matmul on CPU (stated)
    host_args = ["--continuous-batching"] if args.continuous_batching else []
    mode = (f"{args.host}" + (" --continuous-batching" if args.continuous_batching else
                              " (simple mode)" if args.host == "vllm-mlx" else ""))
    everything = {}
    for model_name in args.model or ["kv-heavy"]:
        model_dir = resolve_model(model_name)
        system = TextMaker(model_dir).text(args.prompt_tokens, seed="memory-bench")
        results = []
        with tempfile.TemporaryDirectory(prefix="kvplugin-membench-") as tmp:
            for key in configs:
                print(f"[{model_name}] {CONFIGS[key].label} ...", file=sys.stderr, flush=True)
                results.append(run_one(
                    model_dir, CONFIGS[key], key, system, turns=args.turns,
                    max_tokens=args.max_tokens, prefill_step=args.prefill_step_size,
                    workdir=Path(tmp), env=env, seed=0 if args.sequential else None,
                    host=args.host, host_args=host_args,
                ))
        title = (f"{mode}, {model_name}: one conversation, {results[0].turns[0].prompt_tokens}-token "
                 f"prompt, {args.turns} turns"
                 f"{f', --prefill-step-size {args.prefill_step_size}' if args.host == 'mlx-lm' else ''}"
                 f"{', sequential path (seeded requests)' if args.sequential else ''}"
                 f"{' (OpenBLAS preloaded for every server)' if env else ''}")
        print(table(results, title))
        stem = (f"server_memory_{args.host}{'_cb' if args.continuous_batching else ''}"
                f"{'_seq' if args.sequential else ''}_{Path(model_name).name}")
        plot(results, args.out / f"{stem}.png", title)
        everything[model_name] = results_json(results)
        (args.out / f"{stem}.json").write_text(json.dumps(everything[model_name], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
