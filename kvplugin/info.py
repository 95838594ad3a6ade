"""What ``kvplugin info`` reports: the truth about this environment, as one dict.

Why a module: a user who wonders whether kvplugin is doing anything needs facts, not the
settings alone — is the ``.pth`` that activates it installed, is it switched off (and by
what), which host versions are installed and supported, where each setting comes from
(flag, variable, file, implied, default), which configuration file was read, and where
kvplugin builds its local models. ``--json`` gives the same dict to scripts.
"""

from __future__ import annotations

import os
import site
import sys
from pathlib import Path
from typing import Any, Mapping

import kvplugin
from kvplugin import config_sources
from kvplugin.home import kvplugin_home
from kvplugin.provenance import config_file_in_force, setting_sources
from kvplugin.settings import option_infos, resolve_settings, shown_value

PTH_NAME = "kvplugin.pth"


def _site_dirs() -> list[Path]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if user:
        dirs.append(user)
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(Path(d))
    return out


def activation() -> dict[str, Any]:
    """Whether kvplugin activates at interpreter start here, and if not, why."""
    pth = next((d / PTH_NAME for d in _site_dirs() if (d / PTH_NAME).is_file()), None)
    raw = os.environ.get("KVPLUGIN_DISABLE", "")
    try:
        disabled = config_sources.bool_variable("KVPLUGIN_DISABLE")
        problem = None
    except ValueError as exc:
        disabled, problem = False, str(exc)
    from kvplugin import _bootstrap

    finder = any(getattr(f, "_kvplugin_trigger_finder", False) for f in sys.meta_path)
    if problem:
        state, why = "error", problem + "; a host would refuse to start"
    elif disabled:
        state, why = "disabled", f"KVPLUGIN_DISABLE={raw!r}: hosts run exactly as stock"
    elif pth is None:
        state, why = "inactive", (f"{PTH_NAME} is not in any site-packages of {sys.executable}; "
                                  "reinstall kvplugin into this environment")
    else:
        state, why = "active", "hosts are patched when they are imported"
    return {
        "state": state,
        "why": why,
        "pth": str(pth) if pth else None,
        "finder_installed": finder,
        "triggers": dict(_bootstrap.TRIGGERS),
    }


def server_refusals(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """What a running server kept out of its tiers, by reason (``refused_by_reason``), and
    what its store could not keep, by layer kinds: from its ``GET /kvplugin/stats``.
    Raises ``OSError`` / ``ValueError`` when it cannot be read."""
    import json
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/kvplugin/stats", timeout=timeout_s) as r:
        stats = json.load(r)
    tier = stats.get("cold_tier") or {}
    return {"url": url, "cold_tier": tier.get("refused_by_reason"),
            "remote_tier": tier.get("remote_refused_by_reason"),
            "store_rejected_by_kind": stats.get("rejected_by_kind")}


def collect(flags: Mapping[str, Any], server: str | None = None) -> dict[str, Any]:
    """Everything ``kvplugin info`` prints (raises SettingsError on a bad value); with
    ``server`` (a running server's URL) also what it refused (:func:`server_refusals`)."""
    from kvplugin.codecs import codec_plan
    from kvplugin.hosts import all_adapters
    from kvplugin.plugins import list_plugins

    settings = resolve_settings(flags)
    sources = setting_sources(flags)
    hosts = []
    for adapter in all_adapters():
        version = adapter.version()
        hosts.append({
            "name": adapter.name,
            "version": None if version is None else str(version),
            "supported_range": str(adapter.supported),
            "supported": version is not None and version in adapter.supported,
        })
    config = config_file_in_force()
    return {
        "version": kvplugin.__version__,
        "python": sys.executable,
        "activation": activation(),
        "hosts": hosts,
        "plugins": [{"name": p.name, "origin": p.origin} for p in list_plugins()],
        "config_file": config.describe() if config else None,
        "settings": [
            {"flag": i.flag, "env": i.env, "value": _jsonable(shown_value(i.field, getattr(settings, i.field))),
             "source": sources[i.field]}
            for i in option_infos()
        ],
        # what --kv-cache-codec auto and unset protected tokens resolve to (None: off)
        "codec": codec_plan(settings).description if settings.kv_cache_quantization else None,
        "model_cache": str(kvplugin_home()),
        **({"refusals": server_refusals(server)} if server else {}),
    }


def _jsonable(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def render(info: Mapping[str, Any]) -> str:
    """The human form of :func:`collect`."""
    act = info["activation"]
    lines = [f"kvplugin {info['version']} ({info['python']})",
             f"\nstatus: {act['state']} — {act['why']}",
             f"  activation file: {act['pth'] or 'MISSING'}"]
    lines.append("\nhosts:")
    width = max((len(h["name"]) for h in info["hosts"]), default=10)
    for h in info["hosts"]:
        if h["version"] is None:
            state = "not installed"
        elif h["supported"]:
            state = f"{h['version']} (supported)"
        else:
            state = f"{h['version']} (UNSUPPORTED: runs stock)"
        lines.append(f"  {h['name']:<{width}} {state:<32} supported range: "
                     f"{h['supported_range']}")
    lines.append("\nplugins:")
    lines += [f"  {p['name']:<20} {p['origin']}" for p in info["plugins"]]
    lines.append(f"\nconfiguration file: {info['config_file'] or 'none'}")
    lines.append("\nsettings (flag > env > file > default):")
    for s in info["settings"]:
        lines.append(f"  {s['flag']:<36} {s['value']!s:<12} [{s['source']}]  {s['env']}")
    if info["codec"]:
        lines.append(f"  stored entries' codec (resolved): {info['codec']}")
    lines.append(f"\nmodel cache (tiny and real models built offline): {info['model_cache']}")
    if "refusals" in info:
        r = info["refusals"]
        lines.append(f"\nrefused by the server at {r['url']} (count by reason):")
        for what, key in (("cold tier", "cold_tier"), ("remote tier", "remote_tier"),
                          ("store (by layer kinds)", "store_rejected_by_kind")):
            found = r[key]
            shown = ("not configured" if found is None else
                     ", ".join(f"{k}: {v}" for k, v in sorted(found.items())) or "nothing")
            lines.append(f"  {what:<24} {shown}")
    return "\n".join(lines)
