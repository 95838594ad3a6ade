"""Shared output helpers of the benchmarks: goals, terminal tables, JSON, progress bars.

Nothing here imports mlx; optional dependencies (``tqdm``, ``matplotlib``) are imported lazily
and their absence is reported, never fatal.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "Goal",
    "fmt_bytes",
    "fmt_ratio",
    "format_table",
    "goals_table",
    "write_json",
    "Progress",
    "environment",
    "percentile",
]

MiB = 1 << 20


@dataclass
class Goal:
    """One benchmark target and whether the measured ``value`` meets it.

    ``op`` is ``"<="`` or ``">="``; ``met`` is computed. ``note`` says what was measured and,
    when missed, why.
    """

    name: str
    value: float | None
    limit: float
    op: str = "<="
    unit: str = ""
    note: str = ""
    met: bool | None = field(default=None)

    def __post_init__(self) -> None:
        if self.op not in ("<=", ">="):
            raise ValueError(f"bad goal operator {self.op!r}")
        if self.value is None or (isinstance(self.value, float) and math.isnan(self.value)):
            self.met = None
        else:
            self.met = self.value <= self.limit if self.op == "<=" else self.value >= self.limit

    @property
    def verdict(self) -> str:
        return {True: "met", False: "MISSED", None: "n/a"}[self.met]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["verdict"] = self.verdict
        return out


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_ratio(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}x"


def _fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "x":
        return fmt_ratio(v)
    if unit == "%":
        return f"{v:.2f}%"
    if isinstance(v, float) and (abs(v) < 1e-2 and v != 0):
        return f"{v:.2e}{unit}"
    if isinstance(v, float):
        return f"{v:.4g}{unit}"
    return f"{v}{unit}"


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str = "") -> str:
    """A plain monospace table (first column left-aligned, the others right-aligned)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def line(r: Sequence[str]) -> str:
        return "  ".join(
            (c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])) for i, c in enumerate(r)
        ).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(line(list(headers)))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def goals_table(goals: Sequence[Goal], title: str = "Goals") -> str:
    rows = []
    for g in goals:
        rows.append(
            [g.name, _fmt_value(g.value, g.unit), f"{g.op} {_fmt_value(g.limit, g.unit)}",
             g.verdict]
        )
    table = format_table(["goal", "measured", "target", "verdict"], rows, title)
    notes = [f"  - {g.name}: {g.note}" for g in goals if g.note]
    return table + ("\n" + "\n".join(notes) if notes else "")


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "item"):  # numpy / mlx scalars
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (atomically) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_json_default, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def save_results(path: Path, data: Mapping[str, Any]) -> Path:
    """Write a bench's JSON and say where it and its plots went (every bench ends so)."""
    written = write_json(path, data)
    print(f"\nJSON: {written}")
    for name, plot in (data.get("plots") or {}).items():
        print(f"plot {name}: {plot}")
    return written


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]) of already sorted values."""
    if not sorted_values:
        return float("nan")
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return float(sorted_values[lo] * (1 - frac) + sorted_values[hi] * frac)


class Progress:
    """A tqdm progress bar when tqdm is installed and enabled, else a silent counter.

    Writes to stderr so that the tables on stdout stay clean.
    """

    _warned = False

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                if not Progress._warned:
                    print(
                        "(progress bar disabled: install tqdm to see one)", file=sys.stderr
                    )
                    Progress._warned = True
            else:
                # disable=None: no bar when stderr is not a terminal (logs, CI)
                self._bar = tqdm(total=total, desc=desc, unit="step", leave=False,
                                 file=sys.stderr, mininterval=0.5, disable=None)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def set_description(self, desc: str) -> None:
        if self._bar is not None:
            self._bar.set_description(desc)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every result."""
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "kvplugin": version("kvplugin"),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
    }
    try:
        import mlx.core as mx

        info["mlx_device"] = str(mx.default_device())
        info["metal"] = bool(mx.metal.is_available())
    except Exception:  # pragma: no cover - mlx missing or broken
        pass
    return info
