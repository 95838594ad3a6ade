"""The codec of recurrent state on a trained hybrid: ``kvplugin bench --quality --hybrid``.

Why a trained model: random weights give a recurrent state with no structure, and what a
state codec loses shows only through a model that uses its state. This bench trains (once,
offline, cached) the Qwen3-Next-style hybrid of :mod:`kvplugin.tools.models.quality`
(``HYBRID_SPEC``: a GatedDeltaNet layer, then an attention layer) and, over held-out
documents, compares the entry a hit gives back with the full-precision one, for the default
codec of 8 and 4 bits with the state kept at full precision and with it rotated at 8 bits
(``--kv-cache-quantize-state``): stored bytes against the full-precision entry's (the state
counted), KL of the next-token distributions and top-1 agreement, teacher-forced on the
full-precision entry's greedy continuation, and the perplexity change on the real
continuation. Output: a table, the goals and ``state.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from kvplugin.tools.bench.report import Goal, Progress, environment, format_table, goals_table
from kvplugin.tools.bench.report import save_results

__all__ = ["main", "GOALS"]

#: The state codec keeps 8-bit entries' quality and makes a hybrid entry this much smaller
GOALS = {"smaller_8bit": 1.8, "agreement_8bit": 0.998, "kl_8bit": 1e-4}


def _configs(widths: tuple[int, int]) -> list[tuple[str, int, dict, bool]]:
    """(spec, the bits it is the default of, codec keywords, state quantized) per row."""
    from kvplugin.tools.bench.codec_quality import default_codecs, parse_codec

    out = []
    for spec, bits in default_codecs(widths, recurrent=True).items():  # no window
        if bits in (8, 4):
            kw = parse_codec(spec)
            out += [(spec, bits, kw, state) for state in (False, True)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvplugin bench --quality --hybrid",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quality", action="store_true", help="(selects the quality benches)")
    p.add_argument("--hybrid", action="store_true", help="(selects this bench)")
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 128")
    p.add_argument("--continuation-tokens", type=int, default=None, help="default 128")
    p.add_argument("--docs", type=int, default=None, help="held-out story documents (15)")
    p.add_argument("--quick", action="store_true", help="a seconds-long model (for tests)")
    p.add_argument("--out", type=Path, default=Path("kvplugin-bench"))
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    from kvplugin.tools.bench.quality import DEFAULTS, QUICK, _Evaluator
    from kvplugin.tools.models import quality as qm

    base = QUICK if args.quick else DEFAULTS
    prompt = args.prompt_tokens or base["prompt_tokens"]
    cont = args.continuation_tokens or base["continuation_tokens"]
    n_docs = args.docs or base["docs"]
    spec = qm.QUICK_HYBRID_SPEC if args.quick else qm.HYBRID_SPEC
    start = time.perf_counter()
    model_dir = args.model_dir or qm.default_model_dir(spec)
    if not qm.is_built(model_dir, spec):
        print(f"training the hybrid quality model once ({spec.steps} steps, cached in "
              f"{model_dir}) ...", file=sys.stderr)
        with Progress(spec.steps, "training", enabled=args.progress) as bar:
            qm.build_quality_model(model_dir, spec=spec, progress=lambda i, loss: bar.update())
    model, marker = qm.load_quality_model(model_dir, spec)
    docs = [ids for _, ids in qm.heldout_documents(prompt + cont, n_docs, spec=spec)]
    ev = _Evaluator(model, docs, prompt, cont, free_running=False)
    rows = []
    from kvplugin.tools.bench.codec_quality import model_widths

    for name, bits, kw, state in _configs(model_widths(model)):
        kw = dict(kw)  # the two state rows of a codec share it
        group, key_bits = kw.pop("group_size"), kw.pop("bits")
        row = ev.score(key_bits, group, codec=kw, state=state)
        row.update(codec=name, state_quantized=state, bits=bits)  # the setting's bits
        rows.append(row)
    table = [[r["codec"], "8-bit" if r["state_quantized"] else "full",
              f"{r['stored_bytes'] / r['fp16_bytes']:.3f}",
              f"{r['fp16_bytes'] / r['stored_bytes']:.2f}x", f"{r['kl_mean']:.2e}",
              f"{r['kl_max']:.2e}", f"{100 * r['greedy_agreement']:.2f}%",
              f"{r['ppl_delta_pct']:+.3f}%"] for r in rows]
    title = (f"Recurrent state on a trained hybrid (GatedDeltaNet + attention, "
             f"{marker.get('parameters', '?')} parameters): {len(docs)} held-out documents, "
             f"{prompt}-token entry, {cont}-token continuation")
    print(format_table(["codec", "state", "bytes x full", "smaller", "KL mean", "KL max",
                        "top-1", "ppl delta"], table, title))
    best = next(r for r in rows if r["bits"] == 8 and r["state_quantized"])
    goals = [Goal("8-bit hybrid entry smaller than full precision",
                  best["fp16_bytes"] / best["stored_bytes"], GOALS["smaller_8bit"], op=">=",
                  unit="x"),
             Goal("8-bit with state: top-1", 100 * best["greedy_agreement"],
                  100 * GOALS["agreement_8bit"], op=">=", unit="%"),
             Goal("8-bit with state: KL", best["kl_mean"], GOALS["kl_8bit"], unit=" nats")]
    print()
    print(goals_table(goals))
    args.out.mkdir(parents=True, exist_ok=True)
    save_results(args.out / "state.json", {
        "title": title, "rows": rows, "goals": [g.to_dict() for g in goals], "model": marker,
        "elapsed_s": time.perf_counter() - start, "environment": environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
