"""kvplugin's options on mlx-openai-server's click ``launch`` command (the server process).

Why here and not in the model process: a bad value must stop the server before it starts
anything (click's usage error, exit code 2, naming the flag and the ``KVPLUGIN_*``
variable), and only the server process parses the command line. The model process is
spawned with the server's environment, so every kvplugin flag given is exported as its
variable before the server starts and the child resolves the same settings.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvplugin.hosts.base import config_of, require, wraps_original

__all__ = ["install_options"]

_TYPES: dict[str, Any] = {"ssd_cache_dir": Path, "max_memory": str, "kv_cache_codec": str,
                          "kv_cache_remote": str}
_FLOATS = {"ssd_cache_max_gb", "kv_cache_remote_max_value_mb", "kv_cache_remote_queue_mb"}
SSD_NOTE = "(--prompt-cache-dir is kvplugin's --ssd-cache-dir on this host)"


def _click_options() -> list[Any]:
    import click

    from kvplugin.settings import option_infos

    options = []
    for info in option_infos():
        allowed = f" Allowed: {info.allowed}." if info.allowed and not info.is_bool else ""
        text = f"{info.help}{allowed} [env: {info.env}]"
        if info.is_bool:
            name = info.flag.removeprefix("--")
            options.append(click.Option([f"--{name}/--no-{name}", info.field], default=None,
                                        help=text))
            continue
        kind = _TYPES.get(info.field, float if info.field in _FLOATS else int)
        options.append(click.Option([info.flag, info.field], type=kind, default=None,
                                    help=text))
    return options


def install_options(adapter: Any, cli: Any, patches: Any) -> None:
    """Append the options to ``cli.launch`` and wrap its callback (after checking both)."""
    launch = getattr(cli, "launch", None)
    require(launch is not None and isinstance(getattr(launch, "params", None), list)
            and callable(getattr(launch, "callback", None)), "app.cli.launch (a click command)")
    names = {name for p in launch.params for name in getattr(p, "opts", [])}
    for needed in ("--prompt-cache-dir", "--model-path", "--kv-bits", "--draft-model-path"):
        require(needed in names, f"app.cli.launch {needed}")
    options = _click_options()
    clash = sorted(names & {o for opt in options for o in opt.opts + opt.secondary_opts})
    require(not clash, f"app.cli.launch already has {', '.join(clash)}")
    fields = [opt.name for opt in options]
    patches.replace(launch, "params", [*launch.params, *options])
    patches.replace(launch, "callback", _wrap_callback(adapter, launch.callback, fields))


def _wrap_callback(adapter: Any, original: Callable, fields: list[str]) -> Callable:
    @wraps_original(original)
    def launch(**kwargs: Any) -> Any:
        given = {f: kwargs.pop(f) for f in fields}
        given = {f: v for f, v in given.items() if v is not None}
        settings = checked_settings(adapter, given, kwargs)
        with adapter._state_lock:
            adapter.settings, adapter.given_flags = settings, given
        export(given)
        return original(**kwargs)

    return launch


def checked_settings(adapter: Any, given: dict[str, Any], host: dict[str, Any]) -> Any:
    """The settings of this launch, or click's usage error (exit 2) saying what is wrong."""
    import click

    from kvplugin.cache.service.startup_checks import host_option_conflict
    from kvplugin.settings import SettingsError, resolve_settings

    flags = dict(given)
    cache_dir = host.get("prompt_cache_dir")
    if cache_dir is not None:
        if "ssd_cache_dir" in given and Path(given["ssd_cache_dir"]) != Path(cache_dir):
            raise click.UsageError(
                f"kvplugin: --prompt-cache-dir {cache_dir!r} and --ssd-cache-dir / "
                f"KVPLUGIN_SSD_CACHE_DIR {str(given['ssd_cache_dir'])!r} both name the SSD tier "
                f"{SSD_NOTE}; give one")
        flags["ssd_cache_dir"] = Path(cache_dir)
    try:
        settings = resolve_settings(flags)
    except SettingsError as err:
        note = f" {SSD_NOTE}" if cache_dir is not None and "ssd-cache-dir" in str(err) else ""
        raise click.UsageError(f"{err}{note}") from None
    conflict = host_option_conflict(settings, {"kv_bits": host.get("kv_bits"),
                                               "draft_model": host.get("draft_model_path")})
    if conflict is not None:
        raise click.UsageError(conflict)
    config = config_of(host.get("model_path"))
    if config is not None:  # decided from config.json before any process loads the weights
        problem = adapter.model_problem({"args": config}, settings, given)
        if problem is not None:
            raise click.UsageError(problem)
    return settings


def export(given: dict[str, Any]) -> None:
    """Every flag given as its ``KVPLUGIN_*`` variable: the spawned model process reads them."""
    from kvplugin.settings import option_info

    for field, value in given.items():
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        os.environ[option_info(field).env] = text
