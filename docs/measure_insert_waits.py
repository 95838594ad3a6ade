"""How long the pressure policy's inserting thread waits on the codec (docs/benchmarks.md,
"Precision as a tier"): ``kvplugin bench --pressure`` with a measuring plugin in its servers.

Not part of the package and imported by nothing. The plugin (a module and a ``kvplugin``
entry point, written to a temporary directory on ``PYTHONPATH``, so the servers load it
through the real plugin discovery) appends every ``quantize`` and ``demote`` cache event
with the seconds its codec took, tagged with the server's policy. A ``quantize`` event with
seconds is an entry quantized on the inserting thread under ``pressure``; ``demote`` is the
worker thread's. Prints count, median and maximum per policy and event.

    python docs/measure_insert_waits.py --model kv-heavy --prefix-tokens 1024 --path batched --conversations 15
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PLUGIN = '''import json, os, sys
from kvplugin.hookspecs import hookimpl

POLICY = "pressure" if "pressure" in sys.argv else "always"


@hookimpl
def kvplugin_cache_event(event, tokens, nbytes, seconds):
    if event in ("quantize", "demote") and seconds > 0:
        with open(os.environ["KVP_WAITS_OUT"], "a") as f:
            f.write(json.dumps({"policy": POLICY, "event": event, "tokens": tokens,
                                "seconds": seconds}) + "\\n")
'''


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        (where / "kvp_waits.py").write_text(PLUGIN)
        dist = where / "kvp_waits-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvp-waits\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text("[kvplugin]\nwaits = kvp_waits\n")
        out = where / "waits.jsonl"
        out.touch()
        path = os.pathsep.join(p for p in (str(where), os.environ.get("PYTHONPATH")) if p)
        subprocess.run([sys.executable, "-m", "kvplugin.tools.bench.pressure", "--pressure",
                        *argv], check=True,
                       env={**os.environ, "PYTHONPATH": path, "KVP_WAITS_OUT": str(out)})
        events = [json.loads(line) for line in out.read_text().splitlines()]
    for policy, event in sorted({(e["policy"], e["event"]) for e in events}):
        ms = [1000 * e["seconds"] for e in events
              if (e["policy"], e["event"]) == (policy, event)]
        print(f"{policy} {event}: {len(ms)} timed, median {statistics.median(ms):.1f} ms, "
              f"max {max(ms):.1f} ms (codec seconds from kvplugin's cache events)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
