"""Four conversations on a real mlx_lm.server, stock first, then kvplugin under each flag set:
answers and prompt tokens reused per turn against stock's (docs/benchmarks.md, "A shared
system prompt inside a window").

    python docs/measure_window_share.py MODEL_DIR {batched,seq} stock fp16 "q4=--kv-cache-quantization --kv-cache-quantization-bits 4" ...

A (3 turns) on a ~420-token system prompt, B (3 turns) on the same, C on another, A2 as A
again; 24 greedy tokens per answer; ``seq`` sends seeded requests (mlx-lm's sequential path).
A label starting with ``stock`` runs with KVPLUGIN_DISABLE=1; ``{wd}`` in flags is the run's
scratch directory.
"""
import sys
import tempfile
import time
from pathlib import Path
from kvplugin.tools.hostcmd import mlx_lm_server_cmd, free_port
from kvplugin.tools.hostproc import ServerProcess, answer_text, cached_tokens, ServerStartError
from kvplugin.tools.prompts import TextMaker as PromptMaker

model = Path(sys.argv[1]); seeded = sys.argv[2] == "seq"; configs = sys.argv[3:]
pm = PromptMaker(model)
system = pm.text(420, seed=1)
other = pm.text(300, seed=2)
def convs():
    return [("A", system), ("B", system), ("C", other), ("A2", system)]
def run(flags, env, label):
    port = free_port()
    out = {"answers": [], "cached": [], "prompt": []}
    wd = Path(tempfile.mkdtemp(prefix="sweep-"))
    flags = [f.replace("{wd}", str(wd)) for f in flags]
    with ServerProcess(mlx_lm_server_cmd(model, port, *flags), port=port, env=env, workdir=wd, startup_timeout=300) as srv:
        for name, sp in convs():
            msgs = [{"role": "system", "content": sp}]
            for t in range(3):
                msgs.append({"role": "user", "content": f"{name} question {t+1}: summarize part {t+1} in one sentence."})
                r = srv.chat(msgs, max_tokens=24, seed=(7 if seeded else None))
                a = answer_text(r); msgs.append({"role": "assistant", "content": a})
                out["answers"].append(a); out["cached"].append(cached_tokens(r)); out["prompt"].append(r["usage"]["prompt_tokens"])
        try:
            out["stats"] = srv.get("/kvplugin/stats")
        except Exception as e:
            out["stats"] = str(e)
        log = srv.log_text()
        out["kvlines"] = [l for l in log.splitlines() if "kvplugin" in l][:12]
        out["tracebacks"] = log.count("Traceback")
    return out
base = None
for cfg in configs:
    label, _, rest = cfg.partition("=")
    flags = rest.split() if rest else []
    env = {}
    if label.startswith("stock"):
        env["KVPLUGIN_DISABLE"] = "1"
    for f in list(flags):
        if f.startswith("ENV:"):
            k, v = f[4:].split(":", 1); env[k] = v; flags.remove(f)
    t0 = time.time()
    try:
        r = run(flags, env, label)
    except Exception as e:
        print(f"{label:28} FAILED {type(e).__name__}: {str(e)[-600:]}"); continue
    if base is None:
        base = r
    same = sum(a == b for a, b in zip(r["answers"], base["answers"]))
    reuse = sum(c or 0 for c in r["cached"]); breuse = sum(c or 0 for c in base["cached"])
    st = r["stats"] if isinstance(r["stats"], dict) else {}
    print(f"{label:28} same {same}/{len(base['answers'])} reused {reuse} (base {breuse}) tb {r['tracebacks']} {time.time()-t0:.0f}s  cached {r['cached']}")
    diff = [i for i, (a, b) in enumerate(zip(r["answers"], base["answers"])) if a != b]
    if diff: print("     differ at", diff)
    for l in r["kvlines"][:6]: print("     |", l[:220])
