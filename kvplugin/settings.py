"""Every kvplugin option in one pydantic-settings model.

Each field has one CLI flag (``--`` + the field name with dashes) and one environment
variable (``KVPLUGIN_`` + the field name upper-cased). Values resolve as
**flag > env > default**, exactly: flags are passed as init arguments (pydantic-settings
ranks them above the environment) and only when the user really gave them.

Validation errors are re-raised as :class:`SettingsError`, whose message names the flag,
the env variable, the offending value and the allowed values, because users meet these
errors at server start-up and should not have to guess which spelling they used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "KVPLUGIN_"
ALLOWED_BITS = (2, 3, 4, 5, 6, 8)
ALLOWED_GROUP_SIZES = (32, 64, 128)

Source = Literal["flag", "env", "default"]


class SettingsError(ValueError):
    """A bad option value; the message is meant to be shown to the user as is."""


@dataclass(frozen=True)
class OptionInfo:
    """How one settings field meets the user: its flag, env variable and help."""

    field: str
    flag: str
    env: str
    help: str
    allowed: str
    is_bool: bool


class KVPluginSettings(BaseSettings):
    """The resolved kvplugin configuration of one process."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,
        extra="ignore",
        frozen=True,
        validate_default=True,
    )

    kv_cache_quantization: bool = Field(
        False, description="Store prompt-cache entries quantized."
    )
    kv_cache_quantization_bits: int = Field(
        8,
        description="Bits per element of quantized entries.",
        json_schema_extra={"allowed": ", ".join(map(str, ALLOWED_BITS))},
    )
    kv_cache_quantization_group_size: int = Field(
        64,
        description="Quantization group size; must divide the model's head dimension.",
        json_schema_extra={"allowed": ", ".join(map(str, ALLOWED_GROUP_SIZES))},
    )
    kv_cache_min_quantize_tokens: int = Field(
        256,
        description="Entries shorter than this many tokens stay full precision.",
        json_schema_extra={"allowed": "an integer >= 0"},
    )
    max_kv_size: int | None = Field(
        None,
        description="Bound every request's KV cache to this many tokens "
        "(a rotating cache allocated once). Default: unbounded.",
        json_schema_extra={"allowed": "an integer > 0"},
    )
    kv_cache_step: int | None = Field(
        None,
        description="Growth step (tokens) of unbounded KV caches. Default: the host's (256).",
        json_schema_extra={"allowed": "an integer > 0"},
    )
    hot_cache_only: bool = Field(
        False,
        description="Keep the prompt cache in memory only: evictions are discarded and "
        "nothing is written to disk.",
    )
    ssd_cache_dir: Path | None = Field(
        None,
        description="Directory of the cold (SSD) tier that evicted entries spill to. "
        "Default: no cold tier.",
        json_schema_extra={"allowed": "a writable directory path"},
    )
    ssd_cache_max_gb: float = Field(
        10.0,
        description="Size bound of the cold tier in GB (10^9 bytes).",
        json_schema_extra={"allowed": "a number > 0"},
    )

    @field_validator("kv_cache_quantization_bits")
    @classmethod
    def _bits(cls, v: int) -> int:
        if v not in ALLOWED_BITS:
            raise ValueError("not an allowed bit width")
        return v

    @field_validator("kv_cache_quantization_group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v not in ALLOWED_GROUP_SIZES:
            raise ValueError("not an allowed group size")
        return v

    @field_validator("kv_cache_min_quantize_tokens")
    @classmethod
    def _non_negative(cls, v: int) -> int:
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("max_kv_size", "kv_cache_step")
    @classmethod
    def _positive_or_none(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("must be > 0")
        return v

    @field_validator("ssd_cache_max_gb")
    @classmethod
    def _positive_float(cls, v: float) -> float:
        if not v > 0:
            raise ValueError("must be > 0")
        return v

    @field_validator("ssd_cache_dir")
    @classmethod
    def _writable_dir(cls, v: Path | None) -> Path | None:
        if v is None:
            return None
        v = v.expanduser()
        probe = v
        while not probe.exists():
            if probe.parent == probe:
                break
            probe = probe.parent
        if probe.exists() and not probe.is_dir():
            raise ValueError(f"{probe} is not a directory")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ValueError(f"{probe} is not writable")
        return v

    @model_validator(mode="after")
    def _hot_only_excludes_ssd(self) -> KVPluginSettings:
        if self.hot_cache_only and self.ssd_cache_dir is not None:
            raise ValueError(
                "--hot-cache-only (KVPLUGIN_HOT_CACHE_ONLY) forbids writing to disk, but "
                "--ssd-cache-dir (KVPLUGIN_SSD_CACHE_DIR) names a directory: choose one"
            )
        return self

    @property
    def ssd_cache_max_bytes(self) -> int:
        return int(self.ssd_cache_max_gb * 1e9)


def option_infos() -> list[OptionInfo]:
    """The user-facing description of every option, in declaration order."""
    infos = []
    for name, field in KVPluginSettings.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        is_bool = field.annotation is bool
        infos.append(
            OptionInfo(
                field=name,
                flag="--" + name.replace("_", "-"),
                env=ENV_PREFIX + name.upper(),
                help=field.description or "",
                allowed=str(extra.get("allowed", "true/false (1/0, yes/no)" if is_bool else "")),
                is_bool=is_bool,
            )
        )
    return infos


def option_info(field: str) -> OptionInfo:
    for info in option_infos():
        if info.field == field:
            return info
    raise KeyError(field)


def _describe(error: dict[str, Any], flags: Mapping[str, Any]) -> str:
    loc = error.get("loc") or ()
    if not loc:  # a model-level rule: its message already names flags and env vars
        return str(error["msg"]).removeprefix("Value error, ")
    info = option_info(str(loc[0]))
    if info.field in flags:
        got = f"{info.flag} {flags[info.field]!r}"
    else:
        got = f"{info.env}={os.environ.get(info.env, '')!r}"
    reason = str(error["msg"]).removeprefix("Value error, ")
    return (
        f"invalid value for {info.flag} / {info.env}: got {got} ({reason}); "
        f"allowed: {info.allowed}"
    )


def resolve_settings(flags: Mapping[str, Any] | None = None) -> KVPluginSettings:
    """Build the settings from explicitly given flags (field name -> value) and the env.

    ``flags`` must hold only options the user really passed; ``None`` values are dropped
    so that an argparse default of ``None`` means "not given".
    """
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = set(given) - set(KVPluginSettings.model_fields)
    if unknown:
        raise SettingsError(f"unknown kvplugin option(s): {', '.join(sorted(unknown))}")
    try:
        return KVPluginSettings(**given)
    except ValidationError as exc:
        lines = [_describe(e, given) for e in exc.errors()]
        raise SettingsError("kvplugin: " + "; ".join(lines)) from None


def setting_sources(flags: Mapping[str, Any] | None = None) -> dict[str, Source]:
    """Where each option's value comes from, for ``kvplugin info`` and logs."""
    given = {k for k, v in (flags or {}).items() if v is not None}
    sources: dict[str, Source] = {}
    for info in option_infos():
        if info.field in given:
            sources[info.field] = "flag"
        elif os.environ.get(info.env):
            sources[info.field] = "env"
        else:
            sources[info.field] = "default"
    return sources
