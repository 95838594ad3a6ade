"""Answer quality with quantized stored KV entries: ``kvplugin bench --quality``.

A stored entry is only worth quantizing if the answers that reuse it stay good. This bench
takes a small *trained* causal LM (:mod:`kvplugin.tools.models.quality`, trained offline on first
use and cached) and, for held-out documents (template stories from an unseen seed and held-out
corpus prose),

1. prefills the prompt minus its last token with an fp16 KV cache: the stored entry;
2. makes the entry the host gets back on a hit the way kvplugin does: ``trim_entry`` ->
   ``quantize_entry(bits, group_size)`` -> ``dequantize_entry``;
3. feeds the prompt's last token and continues, comparing with the untouched fp16 entry:

* **KL**: ``KL(p_fp16 || p_quantized)`` of the next-token distributions at every position of
  the fp16 model's greedy continuation (teacher-forced, so both see the same tokens), nats;
* **greedy agreement**: how often the quantized run's top token equals the fp16 greedy token
  at those positions; plus, free-running, how many tokens the quantized run generates before
  its first divergence from the fp16 continuation;
* **perplexity delta** on the real held-out continuation (teacher-forced).

Every continuation token attends to the quantized prompt entry, as after a prompt-cache hit.
Reported for 8, 6, 5, 4, 3, 2 bits x groups 32, 64, 128; for contrast, the same geometry with
random weights at a few widths, and statistics of the keys (outlier channels). Output: a
table, ``quality.json`` and ``quality.png``.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path
from typing import Any

from kvplugin.tools.bench import plots
from kvplugin.tools.bench.report import (
    Goal,
    Progress,
    environment,
    format_table,
    goals_table,
    save_results,
)

__all__ = ["main", "build_parser", "evaluate", "GOALS", "BITS", "GROUPS"]

GOALS = {"kl_8bit": 1e-3, "agreement_8bit": 0.99}
BITS = (8, 6, 5, 4, 3, 2)
GROUPS = (32, 64, 128)
GOAL_GROUP = 64  # the default group size of kvplugin and of both hosts

DEFAULTS = dict(prompt_tokens=128, continuation_tokens=128, docs=15)
QUICK = dict(prompt_tokens=48, continuation_tokens=32, docs=2)


# --------------------------------------------------------------------------- model calls


def _prefill(model, prompts):
    """fp16 cache of ``prompts`` (B, P); returns the cache (evaluated)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(prompts, cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _reused_entry(cache: list, bits: int | None, group_size: int,
                  codec: dict | None = None, state: bool = False) -> tuple[list, dict]:
    """What the host gets back from kvplugin: trimmed, quantized, dequantized (fp16 KVCache).
    ``codec``: more ``quantize_entry`` arguments; ``state``: recurrent state quantized too."""
    from kvplugin.cache.codec.quantize import dequantize_entry, quantize_entry
    from kvplugin.cache.layers import entry_nbytes
    from kvplugin.cache.layers.trim import trim_entry

    entry = trim_entry(copy.deepcopy(cache))
    info = {"fp16_bytes": entry_nbytes(entry)}
    if bits is None:
        return entry, info
    res = quantize_entry(entry, bits=bits, group_size=group_size, quantize_state=state,
                         **(codec or {}))
    info.update(stored_bytes=entry_nbytes(res.cache), layers_quantized=res.quantized,
                layers_skipped=res.skipped)
    return dequantize_entry(res.cache), info


def _logprobs(model, cache: list, tokens):
    """Teacher-forced log-probabilities (fp32) of every next token after ``tokens`` (B, T)."""
    import mlx.core as mx

    logits = model(tokens, cache=cache).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _greedy(model, cache: list, first, steps: int):
    """Free-running greedy generation of ``steps`` tokens after ``first`` (B, 1)."""
    import mlx.core as mx

    out = []
    tok = first
    for _ in range(steps):
        logits = model(tok, cache=cache)[:, -1, :]
        tok = mx.argmax(logits, axis=-1, keepdims=True)
        out.append(tok)
        mx.eval(tok)
    return mx.concatenate(out, axis=1)


def _key_stats(cache: list) -> dict[str, float]:
    """How peaked the key channels are: per-channel RMS over heads and tokens, per layer;
    reports the largest ``max / median`` channel ratio and the mean excess kurtosis of the
    key values (0 for a Gaussian)."""
    import mlx.core as mx

    ratios, kurts = [], []
    for c in cache:
        if getattr(c, "keys", None) is None:  # recurrent state: no keys
            continue
        k = c.keys[..., : c.offset, :].astype(mx.float32)  # B, H, T, D
        rms = mx.sqrt(mx.mean(k * k, axis=(0, 1, 2)))
        srt = mx.sort(rms)
        ratios.append(float((srt[-1] / srt[srt.shape[0] // 2]).item()))
        x = k.reshape(-1)
        x = x - mx.mean(x)
        var = mx.mean(x * x)
        kurts.append(float((mx.mean(x ** 4) / (var * var) - 3.0).item()))
    return {"max_over_median_channel_rms": max(ratios), "mean_excess_kurtosis":
            sum(kurts) / len(kurts)}


class _Evaluator:
    """Holds the fp16 references for one model and scores one (bits, group) at a time."""

    def __init__(self, model, docs: list[list[int]], prompt: int, cont: int,
                 free_running: bool) -> None:
        import mlx.core as mx

        self.model = model
        data = mx.array([d[: prompt + cont] for d in docs])
        self.prefix = data[:, : prompt - 1]
        self.last = data[:, prompt - 1: prompt]
        self.real = data[:, prompt: prompt + cont]
        self.cont = cont
        self.free_running = free_running
        self.cache = _prefill(model, self.prefix)
        self.key_stats = _key_stats(self.cache)
        ref, _ = _reused_entry(self.cache, None, 64)  # trimmed, full precision
        # fp16 greedy continuation, then the reference distributions along it
        self.greedy = _greedy(model, copy.deepcopy(ref), self.last, cont)
        self.ref_lp = self._lp(copy.deepcopy(ref), self.greedy)
        self.ref_nll = self._nll(copy.deepcopy(ref), self.real)
        mx.eval(self.greedy, self.ref_lp, self.ref_nll)

    def _lp(self, cache, cont):
        import mlx.core as mx

        inputs = mx.concatenate([self.last, cont[:, :-1]], axis=1)
        return _logprobs(self.model, cache, inputs)

    def _nll(self, cache, real):
        import mlx.core as mx

        lp = self._lp(cache, real)
        return -mx.take_along_axis(lp, real[..., None], axis=-1)[..., 0]

    def score(self, bits: int | None, group_size: int, codec: dict | None = None,
              state: bool = False) -> dict[str, Any]:
        import mlx.core as mx

        entry, info = _reused_entry(self.cache, bits, group_size, codec, state)
        row: dict[str, Any] = {"bits": bits, "group_size": group_size, **info}
        if bits is not None and info.get("layers_quantized", 0) == 0:
            row["skipped"] = "no layer could be quantized (group size vs head_dim)"
            return row
        lp = self._lp(copy.deepcopy(entry), self.greedy)
        p_ref = mx.exp(self.ref_lp)
        kl = mx.sum(p_ref * (self.ref_lp - lp), axis=-1)  # (B, C)
        agree = mx.argmax(lp, axis=-1) == self.greedy
        nll = self._nll(copy.deepcopy(entry), self.real)
        mx.eval(kl, agree, nll)
        ppl_ref = math.exp(float(mx.mean(self.ref_nll).item()))
        ppl = math.exp(float(mx.mean(nll).item()))
        row.update(
            kl_mean=max(float(mx.mean(kl).item()), 0.0),
            kl_p99=float(mx.sort(kl.reshape(-1))[int(0.99 * (kl.size - 1))].item()),
            kl_max=float(mx.max(kl).item()),
            greedy_agreement=float(mx.mean(agree.astype(mx.float32)).item()),
            positions=int(kl.size),
            ppl_fp16=ppl_ref,
            ppl=ppl,
            ppl_delta=ppl - ppl_ref,
            ppl_delta_pct=100.0 * (ppl - ppl_ref) / ppl_ref,
        )
        if self.free_running:
            gen = _greedy(self.model, entry, self.last, self.cont)
            same = (gen == self.greedy).astype(mx.int32)
            # tokens generated before the first divergence, per document
            run = mx.sum(mx.cumprod(same, axis=1), axis=1)
            mx.eval(run, same)
            row["free_running_match"] = float(mx.mean(same.astype(mx.float32)).item())
            row["tokens_before_divergence_mean"] = float(mx.mean(run.astype(mx.float32)).item())
            row["tokens_before_divergence_min"] = int(mx.min(run).item())
        return row


# --------------------------------------------------------------------------- run


def evaluate(model, docs: list[list[int]], prompt: int, cont: int, *, free_running: bool,
             configs: list[tuple[int, int]], bar: Progress | None = None) -> dict[str, Any]:
    ev = _Evaluator(model, docs, prompt, cont, free_running)
    rows = []
    for bits, g in configs:
        if bar is not None:
            bar.set_description(f"quality: {bits}-bit g{g}")
        rows.append(ev.score(bits, g))
        if bar is not None:
            bar.update()
    return {"rows": rows, "key_stats": ev.key_stats, "ppl_fp16": rows[0].get("ppl_fp16")}


def _goals(rows: list[dict[str, Any]]) -> list[Goal]:
    r = next(x for x in rows if x["bits"] == 8 and x["group_size"] == GOAL_GROUP)
    others = ", ".join(
        f"g{x['group_size']}: KL {x['kl_mean']:.2e}, {100 * x['greedy_agreement']:.2f}%"
        for x in rows if x["bits"] == 8 and x["group_size"] != GOAL_GROUP and "kl_mean" in x)
    note = f"group {GOAL_GROUP}, {r['positions']} positions; other groups at 8 bits: {others}"
    return [
        Goal("8-bit KL divergence vs fp16 KV", r["kl_mean"], GOALS["kl_8bit"], unit=" nats",
             note=note),
        Goal("8-bit greedy agreement", 100 * r["greedy_agreement"],
             100 * GOALS["agreement_8bit"], op=">=", unit="%",
             note=f"teacher-forced on the fp16 greedy continuation; free-running: "
                  f"{r.get('tokens_before_divergence_mean', float('nan')):.1f} tokens on "
                  f"average before the first divergence"),
    ]


def _table(res: dict[str, Any]) -> str:
    rows = []
    for r in res["trained"]["rows"]:
        if "kl_mean" not in r:
            rows.append([f"{r['bits']}", str(r["group_size"]), r.get("skipped", "-")])
            continue
        rows.append([
            str(r["bits"]), str(r["group_size"]), f"{r['stored_bytes'] / r['fp16_bytes']:.4f}",
            f"{r['kl_mean']:.2e}", f"{r['kl_p99']:.2e}", f"{r['kl_max']:.2e}",
            f"{100 * r['greedy_agreement']:.2f}%",
            (f"{100 * r['free_running_match']:.1f}%" if "free_running_match" in r else "-"),
            (f"{r['tokens_before_divergence_mean']:.0f}/{r['tokens_before_divergence_min']}"
             if "tokens_before_divergence_mean" in r else "-"),
            f"{r['ppl']:.4f}", f"{r['ppl_delta']:+.4f} ({r['ppl_delta_pct']:+.3f}%)",
        ])
    cfg = res["config"]
    out = [format_table(
        ["bits", "group", "bytes x fp16", "KL mean", "KL p99", "KL max", "greedy agree",
         "free-run match",
         "tokens to 1st diff (mean/min)", "ppl", "ppl delta"], rows,
        f"KV quantization quality: {cfg['documents']} held-out documents, "
        f"{cfg['prompt_tokens']}-token prompt (stored entry), {cfg['continuation_tokens']}-token "
        f"continuation; fp16-KV perplexity {res['trained']['ppl_fp16']:.4f}")]
    rnd = res.get("random_init")
    if rnd:
        rows = [[str(r["bits"]), str(r["group_size"]), f"{r['kl_mean']:.2e}",
                 f"{t['kl_mean']:.2e}", f"{t['kl_mean'] / max(r['kl_mean'], 1e-30):.1f}x"]
                for r in rnd["rows"] if "kl_mean" in r
                for t in res["trained"]["rows"]
                if t["bits"] == r["bits"] and t["group_size"] == r["group_size"]]
        out.append(format_table(["bits", "group", "KL random init", "KL trained", "trained/random"],
                                rows, "Contrast: the same geometry with random weights "
                                "(untrained)"))
        ks, kr = res["trained"]["key_stats"], rnd["key_stats"]
        out.append(format_table(
            ["keys of", "max/median channel RMS", "excess kurtosis"],
            [["trained model", f"{ks['max_over_median_channel_rms']:.2f}",
              f"{ks['mean_excess_kurtosis']:.2f}"],
             ["random init", f"{kr['max_over_median_channel_rms']:.2f}",
              f"{kr['mean_excess_kurtosis']:.2f}"]],
            "Key outlier channels (per-channel RMS over tokens, worst layer)"))
    return "\n\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvplugin bench --quality",
        description="Answer quality of quantized stored KV entries on a tiny trained model.")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="where the trained model is cached (default: "
                        "~/.cache/kvplugin/quality-model-v1, or $KVPLUGIN_HOME)")
    p.add_argument("--retrain", action="store_true", help="train again even if cached")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 128")
    p.add_argument("--continuation-tokens", type=int, default=None, help="default 128")
    p.add_argument("--docs", type=int, default=None,
                   help="held-out story documents (plus one of held-out corpus prose; default 15)")
    p.add_argument("--no-free-running", dest="free_running", action="store_false",
                   help="skip the free-running greedy generations (the slow part)")
    p.add_argument("--out", type=Path, default=Path("kvplugin-bench"),
                   help="directory for quality.json and quality.png")
    p.add_argument("--quick", action="store_true",
                   help="a seconds-long model and tiny evaluation (for tests)")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--real-model", action="store_true",
                   help="codecs on SmolLM2-135M and real text instead "
                   "(kvplugin.tools.bench.codec_quality; its own options)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--real-model" in argv:  # codecs on SmolLM2: kvplugin.tools.bench.codec_quality
        from kvplugin.tools.bench import codec_quality

        return codec_quality.main(argv)
    args = build_parser().parse_args(argv)
    try:
        import mlx.core as mx
        import mlx_lm  # noqa: F401
    except ImportError as e:
        print(f"kvplugin bench --quality needs mlx and mlx-lm: {e}", file=sys.stderr)
        return 2
    from kvplugin.tools.models import quality as qm

    base = QUICK if args.quick else DEFAULTS
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    spec = qm.QUICK_SPEC if args.quick else qm.SPEC
    if not 2 <= args.prompt_tokens or args.continuation_tokens < 1:
        raise SystemExit("kvplugin bench --quality: need --prompt-tokens >= 2 and "
                         "--continuation-tokens >= 1")
    if args.prompt_tokens + args.continuation_tokens > spec.seq_len:
        print(f"note: prompt + continuation ({args.prompt_tokens + args.continuation_tokens}) "
              f"exceeds the trained context ({spec.seq_len} tokens)", file=sys.stderr)
    t_start = time.perf_counter()
    model_dir = args.model_dir or qm.default_model_dir(spec)
    trained_now = args.retrain or not qm.is_built(model_dir, spec)
    if trained_now:
        print(f"training the quality model once ({spec.steps} steps, cached in {model_dir}) ...",
              file=sys.stderr)
        with Progress(spec.steps, "training", enabled=args.progress) as bar:
            def progress(i: int, loss: float) -> None:
                bar.update()
                if i % 10 == 0:
                    bar.set_description(f"training (loss {loss:.3f})")
            qm.build_quality_model(model_dir, spec=spec, force=args.retrain, progress=progress)
    model, marker = qm.load_quality_model(model_dir, spec)

    length = args.prompt_tokens + args.continuation_tokens
    docs = [ids for _, ids in qm.heldout_documents(length, args.docs, spec=spec)]
    configs = [(b, g) for b in BITS for g in GROUPS]
    rnd_configs = [(8, 64), (4, 64), (2, 64)]
    res: dict[str, Any] = {
        "config": {"prompt_tokens": args.prompt_tokens,
                   "continuation_tokens": args.continuation_tokens,
                   "documents": len(docs), "story_docs": args.docs,
                   "free_running": args.free_running, "quick": args.quick,
                   "model_dir": str(model_dir), "trained_now": trained_now},
        "model": marker,
        "environment": environment(),
        "goal_limits": GOALS,
    }
    with Progress(len(configs) + len(rnd_configs), "quality", enabled=args.progress) as bar:
        res["trained"] = evaluate(model, docs, args.prompt_tokens, args.continuation_tokens,
                                  free_running=args.free_running, configs=configs, bar=bar)
        mx.random.seed(spec.seed + 1)
        rnd = qm._new_model(spec)
        rnd.set_dtype(mx.float16)
        mx.eval(rnd.parameters())
        res["random_init"] = evaluate(rnd, docs, args.prompt_tokens, args.continuation_tokens,
                                      free_running=False, configs=rnd_configs, bar=bar)
    res["elapsed_s"] = time.perf_counter() - t_start
    goals = _goals(res["trained"]["rows"])
    res["goals"] = [g.to_dict() for g in goals]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    res["plots"] = {}
    if args.plots:
        if plots.available():
            p = plots.plot_quality(
                [r for r in res["trained"]["rows"] if "kl_mean" in r], out / "quality.png",
                f"Quantized KV entries on a tiny trained model ({len(docs)} docs, "
                f"{args.continuation_tokens}-token continuations) - CPU")
            res["plots"]["quality"] = str(p) if p else None
        else:
            print(plots.MISSING_MESSAGE, file=sys.stderr)
    m = marker
    held = m.get("heldout_loss", {})
    print(f"kvplugin quality bench - model {model_dir} ({m.get('parameters', '?')} parameters, "
          f"trained {m.get('train_seconds', float('nan')):.0f} s on "
          f"{m.get('train_tokens', '?')} tokens; held-out loss: stories "
          f"{held.get('story', float('nan')):.3f}, prose {held.get('prose', float('nan')):.3f} "
          f"nats/token), device {res['environment'].get('mlx_device', '?')}, "
          f"{res['elapsed_s']:.0f} s\n")
    print(_table(res))
    print()
    print(goals_table(goals))
    save_results(out / "quality.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
