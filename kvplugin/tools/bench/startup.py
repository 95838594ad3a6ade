"""What kvplugin's ``.pth`` activation adds to every interpreter start.

``python -m kvplugin.tools.bench.startup [--runs N]`` measures, in fresh interpreters:

* ``pth_ms``: the cost of executing the installed ``kvplugin.pth`` line cold — in each
  fresh interpreter kvplugin's modules and finder are removed and the line is executed
  again under a timer (the files are in the OS cache either way, as they are for a real
  start);
* ``importtime_us``: what ``python -X importtime -c pass`` attributes to ``kvplugin``
  modules at start-up;
* ``python -c pass`` wall time, for scale.

The goal is <= 5 ms added to ``python -c pass``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PROBE = r"""
import sys, time
for name in [m for m in sys.modules if m == "kvplugin" or m.startswith("kvplugin.")]:
    del sys.modules[name]
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_kvplugin_trigger_finder", 0)]
line = open(sys.argv[1]).read()
t = time.perf_counter()
exec(line)
print((time.perf_counter() - t) * 1000)
"""


def find_pth() -> Path:
    path = Path(sysconfig.get_paths()["purelib"]) / "kvplugin.pth"
    if not path.exists():
        raise SystemExit(f"kvplugin.pth not found in {path.parent}: is kvplugin installed?")
    return path


def pth_cost_ms(pth: Path, runs: int) -> list[float]:
    return [
        float(subprocess.check_output([sys.executable, "-c", PROBE, str(pth)], text=True))
        for _ in range(runs)
    ]


def importtime_us() -> int:
    err = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True
    ).stderr
    total = 0
    for line in err.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2].lstrip().startswith("kvplugin") and parts[0].isdigit():
            total += int(parts[0])  # self time, so nested modules are not counted twice
    return total


def wall_ms(args: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, *args], check=True)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    pth = find_pth()
    costs = pth_cost_ms(pth, args.runs)
    result = {
        "pth_ms_median": round(statistics.median(costs), 3),
        "pth_ms_max": round(max(costs), 3),
        "importtime_us": importtime_us(),
        "python_c_pass_ms": round(wall_ms(["-c", "pass"], args.runs), 2),
        "python_S_c_pass_ms": round(wall_ms(["-S", "-c", "pass"], args.runs), 2),
        "goal_ms": 5.0,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
        verdict = "meets" if result["pth_ms_median"] <= 5.0 else "MISSES"
        print(f"kvplugin.pth adds {result['pth_ms_median']} ms (median): {verdict} the 5 ms goal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
