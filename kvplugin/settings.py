"""Every kvplugin option in one pydantic-settings model.

Each field has one CLI flag (``--`` + the field name with dashes), one environment
variable (``KVPLUGIN_`` + the field name upper-cased) and one key in the configuration
file (the field name; see :mod:`kvplugin.config_sources`). Values resolve as
**flag > env > file > default**, exactly: flags are passed as init arguments
(pydantic-settings ranks them above the environment, and the environment above its own TOML
source) and only when the user really gave them.

Nothing is a silent no-op: a bits, group-size or threshold setting without
``kv_cache_quantization`` turns quantization on (unless it was explicitly switched off), an
unknown ``KVPLUGIN_*`` variable or file key is named with its likely intended spelling, and
booleans accept only true/false, 1/0, yes/no, on/off.

Validation errors are re-raised as :class:`SettingsError`, whose message names the flag,
the env variable, the offending value and the allowed values, because users meet these
errors at server start-up and should not have to guess which spelling they used.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvplugin import config_sources
from kvplugin.codecs import CHOICES as KV_CACHE_CODECS
from kvplugin.config_sources import BOOL_WORDS, ENV_PREFIX, ConfigFile, ConfigFileError
from kvplugin.resources import check_redis_url, masked_url

# The file the current resolve_settings() call reads (pydantic-settings builds its sources
# in a classmethod, so the choice travels in a context variable, not a global).
_CONFIG_FILE: contextvars.ContextVar[ConfigFile | None] = contextvars.ContextVar(
    "kvplugin_config_file", default=None
)
# Options that only make sense with quantization: giving one turns quantization on.
QUANTIZATION_DETAILS = (
    "kv_cache_quantization_bits",
    "kv_cache_quantization_group_size",
    "kv_cache_min_quantize_tokens",
    "kv_cache_codec",
    "kv_cache_key_bits",
    "kv_cache_value_bits",
    "kv_cache_sink_tokens",
    "kv_cache_recent_tokens",
    "kv_cache_quantization_policy",
)
ALLOWED_BITS = (2, 3, 4, 5, 6, 8)
ALLOWED_GROUP_SIZES = (32, 64, 128)
POLICIES = ("always", "pressure")

Source = Literal["flag", "env", "file", "implied", "default"]


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

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """flag (init) > env > the one TOML file > default; no dotenv, no secrets dir."""
        config = _CONFIG_FILE.get()
        if config is None:
            return init_settings, env_settings
        toml = TomlConfigSettingsSource(
            settings_cls, toml_file=config.path, toml_table_header=config.table or None
        )
        return init_settings, env_settings, toml

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
    kv_cache_codec: str = Field(
        "auto",
        description="Codec of quantized entries: affine (per-token groups), rotated (a seeded "
        "Hadamard along head_dim first), rotated-channel (rotated, keys per channel in groups of "
        "group-size tokens), rotated-channel-sym (the same, values with a scale only: smaller), or"
        " auto: affine from 6 key bits on, rotated-channel below, rotated-channel-sym at 3 bits "
        "and below (docs/benchmarks.md); with no key or value bits given, 8 bits take "
        "rotated-channel in entries with a sliding-window or --max-kv-size layer or recurrent "
        "state; in entries with such a layer at 4 and 3 bits (no group size given) heads a group "
        "of 128 divides take k5v4 and k4v2 in groups of 128, and at 4 bits the layer in ten whose "
        "keys quantize worst 6-bit keys, paid for by the best. A named codec the head dimension "
        "cannot take stops the server; auto falls back (to affine for non-power-of-two head dims).",
        json_schema_extra={"allowed": ", ".join(KV_CACHE_CODECS)},
    )
    kv_cache_key_bits: int | None = Field(
        None,
        description="Bits of quantized keys. Default: the quantization bits.",
        json_schema_extra={"allowed": ", ".join(map(str, ALLOWED_BITS))},
    )
    kv_cache_value_bits: int | None = Field(
        None,
        description="Bits of quantized values. Default: the quantization bits.",
        json_schema_extra={"allowed": ", ".join(map(str, ALLOWED_BITS))},
    )
    kv_cache_sink_tokens: int | None = Field(
        None,
        description="The first tokens of a quantized entry (attention sinks) kept at full "
        "precision besides. Default: 4 with the rotated codecs below 6 bits, else 0.",
        json_schema_extra={"allowed": "an integer >= 0"},
    )
    kv_cache_recent_tokens: int | None = Field(
        None,
        description="The last tokens of a quantized entry, and as many before each earlier "
        "prompt's end inside it (where a repeated or edited turn reuses it), kept at full "
        "precision besides. Default: 16 with the rotated codecs below 6 bits (6 with "
        "rotated-channel-sym), else 0.",
        json_schema_extra={"allowed": "an integer >= 0"},
    )
    kv_cache_quantization_policy: str = Field(
        "always",
        description="When entries are quantized: always (as they are stored), or pressure "
        "(stored at full precision; a worker thread quantizes the least recently used in place "
        "as the byte budget fills, before any is evicted; docs/store.md).",
        json_schema_extra={"allowed": "always, pressure"},
    )
    kv_cache_quantize_state: bool = Field(
        True,
        description="With quantization on, also store recurrent state (Mamba, GatedDeltaNet, "
        "Falcon-H1's SSM half) rotated at 8 bits; off: kept at full precision.",
    )
    kv_cache_prerope_keys: bool = Field(
        True,
        description="With quantization on, rotated-channel keys (the 4-bit default) of an entry with "
        "sliding-window or --max-kv-size layers (all its layers) are stored with the model's RoPE taken out at each "
        "token's position and put back on restore, where kvplugin knows the layer's RoPE; "
        "off: stored as the model made them.",
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
        "Default: no cold tier. Processes may share one; an existing read-only directory "
        "is served, never written.",
        json_schema_extra={"allowed": "a writable directory path, or an existing readable one"},
    )
    max_memory: str = Field(
        "auto",
        description="Admission limit on the process's MLX memory: a request whose estimated "
        "peak does not fit is refused (413, or 503 + Retry-After while others hold the "
        "memory) instead of running out of memory. 'auto': the machine's physical memory; "
        "'off': no admission control.",
        json_schema_extra={"allowed": "bytes with a unit (12GiB, 800MB, 1e9), a fraction of "
                                      "physical memory (0.75, 75%), auto or off"},
    )
    ssd_cache_max_gb: float = Field(
        10.0,
        description="Size bound of the cold tier in GB (10^9 bytes): of everything in the "
        "directory, whatever processes and models share it.",
        json_schema_extra={"allowed": "a number > 0"},
    )

    kv_cache_remote: str | None = Field(
        None,
        description="A Redis/Valkey server shared by replicas, behind the hot and SSD tiers: "
        "every stored entry is published there (off the request thread) and a local miss "
        "looks there, in two round trips. Off under --hot-cache-only. See docs/remote.md.",
        json_schema_extra={"allowed": "redis://[user:pass@]host:port/db, rediss://... (TLS; "
                                      "?ssl_ca_certs=/path/ca.pem names the CA to trust) "
                                      "or unix:///path/to/socket"},
    )
    kv_cache_remote_timeout_ms: int = Field(
        50,
        description="Connect and lookup timeout of the remote tier; a slower Redis is a miss.",
        json_schema_extra={"allowed": "an integer > 0"},
    )
    kv_cache_remote_fetch_timeout_ms: int = Field(
        5000,
        description="The longest a request waits for one entry's bytes from the remote tier "
        "(the lookup included); past it the request prefills locally. A Redis that stops "
        "sending is given up sooner (no byte for max(4 x the timeout, 250 ms)).",
        json_schema_extra={"allowed": "an integer > 0"},
    )
    kv_cache_remote_ttl_s: int = Field(
        3600,
        description="Expiry (seconds) of everything kvplugin writes to the remote tier.",
        json_schema_extra={"allowed": "an integer > 0"},
    )
    kv_cache_remote_block_tokens: int = Field(
        128,
        description="Granularity of the remote tier's prefix index: a prefix shared with a "
        "stored entry is found once it spans one block; the hit then covers every common token.",
        json_schema_extra={"allowed": "an integer > 0"},
    )
    kv_cache_remote_max_value_mb: float = Field(
        512.0,
        description="The largest entry (MB, 10^6 bytes) written to or accepted from the "
        "remote tier.",
        json_schema_extra={"allowed": "a number > 0"},
    )
    kv_cache_remote_queue_mb: float = Field(
        256.0,
        description="Memory (MB) that entries waiting to be written to the remote tier may "
        "hold; past it a write is dropped and counted.",
        json_schema_extra={"allowed": "a number > 0"},
    )
    kv_cache_require_salt: bool = Field(
        False,
        description="Refuse (HTTP 400) a generation request without a 'cache_salt' (vLLM's "
        "request field), for a cache that serves several tenants: requests of different "
        "salts never share a prefix, in any tier. See docs/configuration.md#tenants.",
    )

    @field_validator("kv_cache_quantization", "hot_cache_only", "kv_cache_require_salt",
                     "kv_cache_quantize_state", "kv_cache_prerope_keys",
                     mode="before")
    @classmethod
    def _strict_bool(cls, v: Any) -> Any:
        """pydantic also takes "t", "y", "f", "n" ...; users get exactly the documented words."""
        if isinstance(v, str):
            parsed = config_sources.parse_bool_word(v)
            if parsed is None:
                raise ValueError("not a boolean")
            return parsed
        return v

    @model_validator(mode="before")
    @classmethod
    def _details_imply_quantization(cls, data: Any) -> Any:
        """``--kv-cache-quantization-bits 4`` alone means "quantize at 4 bits", not "no-op"."""
        if isinstance(data, dict) and "kv_cache_quantization" not in data:
            if any(data.get(name) not in (None, "") for name in QUANTIZATION_DETAILS):
                data = {**data, "kv_cache_quantization": True}
        return data

    @field_validator("kv_cache_quantization_bits", "kv_cache_key_bits", "kv_cache_value_bits")
    @classmethod
    def _bits(cls, v: int | None) -> int | None:
        if v is not None and v not in ALLOWED_BITS:
            raise ValueError("not an allowed bit width")
        return v

    @field_validator("kv_cache_codec", "kv_cache_quantization_policy")
    @classmethod
    def _choice(cls, v: str, info: ValidationInfo) -> str:
        if v not in (KV_CACHE_CODECS if info.field_name == "kv_cache_codec" else POLICIES):
            raise ValueError("not a known " + info.field_name.rsplit("_", 1)[-1])
        return v

    @field_validator("kv_cache_quantization_group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v not in ALLOWED_GROUP_SIZES:
            raise ValueError("not an allowed group size")
        return v

    @field_validator("kv_cache_min_quantize_tokens", "kv_cache_sink_tokens",
                     "kv_cache_recent_tokens")
    @classmethod
    def _non_negative(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("max_kv_size", "kv_cache_step", "kv_cache_remote_timeout_ms",
                     "kv_cache_remote_fetch_timeout_ms", "kv_cache_remote_ttl_s",
                     "kv_cache_remote_block_tokens", "ssd_cache_max_gb",
                     "kv_cache_remote_max_value_mb", "kv_cache_remote_queue_mb")
    @classmethod
    def _positive(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError("must be > 0")
        return v

    @field_validator("max_memory", mode="before")
    @classmethod
    def _memory_size(cls, v: Any) -> str:
        from kvplugin.resources import parse_memory_limit

        text = str(v).strip()
        parse_memory_limit(text)  # ValueError names what is wrong
        return text.lower() if text.lower() in ("auto", "off") else text

    @field_validator("kv_cache_remote")
    @classmethod
    def _remote_url(cls, v: str | None) -> str | None:
        """The URL's shape, before the server listens; reachability is the tier's business
        (a Redis that is down is served around, a wrong password stops the start)."""
        return None if v is None else check_redis_url(v)

    @field_validator("ssd_cache_dir")
    @classmethod
    def _usable_dir(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        """Tried before the server listens (created? listed? written?), nothing left behind;
        not under --hot-cache-only, which does not use it (a notice says so)."""
        if v is None:
            return None
        v = v.expanduser()
        if not info.data.get("hot_cache_only"):
            from kvplugin.resources import usable_directory

            usable_directory(v)  # ValueError says why; read-only is served (the tier says so)
        return v

    @property
    def max_memory_bytes(self) -> int | None:
        """The admission limit in bytes; ``None``: no admission control (``off``)."""
        from kvplugin.resources import parse_memory_limit

        return parse_memory_limit(self.max_memory)

    @property
    def ssd_cache_max_bytes(self) -> int:
        return int(self.ssd_cache_max_gb * 1e9)

    @property
    def remote_url(self) -> str | None:
        """The remote tier in force: none under ``hot_cache_only`` (nothing leaves the
        process), which :func:`kvplugin.provenance.notices` says."""
        return None if self.hot_cache_only else self.kv_cache_remote

    @property
    def cold_tier_dir(self) -> Path | None:
        """The SSD tier's directory in force: none under ``hot_cache_only``.

        ``--hot-cache-only`` is a switch over whatever tier is configured (oMLX's
        ``hot_cache_only``): a launch script or shell profile that always names a
        directory must not stop the server, so the switch wins and :func:`kvplugin.provenance.notices` says
        the directory is not used.
        """
        return None if self.hot_cache_only else self.ssd_cache_dir


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
                allowed=str(extra.get("allowed", BOOL_WORDS if is_bool else "")),
                is_bool=is_bool,
            )
        )
    return infos


def shown_value(field: str, value: Any) -> Any:
    """A setting's value as kvplugin prints it: a URL's password never leaves the process."""
    if field == "kv_cache_remote" and isinstance(value, str):
        return masked_url(value)
    return str(value) if isinstance(value, Path) else value


def option_info(field: str) -> OptionInfo:
    return {info.field: info for info in option_infos()}[field]


def _describe(
    error: dict[str, Any], flags: Mapping[str, Any], file: ConfigFile | None, file_data: Mapping
) -> str:
    loc = error.get("loc") or ()
    if not loc:  # a model-level rule: its message already names flags and env vars
        return str(error["msg"]).removeprefix("Value error, ")
    info = option_info(str(loc[0]))
    if info.field in flags:
        got = f"{info.flag} {shown_value(info.field, flags[info.field])!r}"
    elif os.environ.get(info.env, "").strip():
        got = f"{info.env}={shown_value(info.field, os.environ.get(info.env, ''))!r}"
    elif file is not None and info.field in file_data:
        got = (f"{info.field} = {shown_value(info.field, file_data[info.field])!r} in "
               f"{file.describe()}")
    else:
        got = "the default"
    reason = str(error["msg"]).removeprefix("Value error, ")
    return (
        f"invalid value for {info.flag} / {info.env}: got {got} ({reason}); "
        f"allowed: {info.allowed}"
    )


def _config_file() -> tuple[ConfigFile | None, dict]:
    """The configuration file in force and its kvplugin table, checked for unknown keys."""
    try:
        file = config_sources.find_config_file()
        data = file.read() if file is not None else {}
    except ConfigFileError as exc:
        raise SettingsError(f"kvplugin: configuration file: {exc}") from None
    fields = list(KVPluginSettings.model_fields)
    bad = []
    for key in data:
        if key not in fields:
            hint = config_sources.closest(key.replace("-", "_"), fields)
            bad.append(f"unknown key {key!r}" + (f" (did you mean {hint!r}?)" if hint else ""))
    if bad:
        raise SettingsError(f"kvplugin: configuration file {file.describe()}: " + "; ".join(bad))
    return file, data


def _check_process_variables() -> None:
    """``KVPLUGIN_DISABLE=maybe`` must not leave kvplugin silently active."""
    try:
        config_sources.bool_variable("KVPLUGIN_DISABLE")
    except ValueError as exc:
        raise SettingsError(f"kvplugin: {exc}") from None


def resolve_settings(flags: Mapping[str, Any] | None = None) -> KVPluginSettings:
    """Build the settings from explicitly given flags (field name -> value), the env and
    the configuration file.

    ``flags`` must hold only options the user really passed; ``None`` values are dropped
    so that an argparse default of ``None`` means "not given". Unknown ``KVPLUGIN_*``
    variables are warned about (once each), never silently ignored.
    """
    from kvplugin.log import say

    given = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = set(given) - set(KVPluginSettings.model_fields)
    if unknown:
        raise SettingsError(f"unknown kvplugin option(s): {', '.join(sorted(unknown))}")
    _check_process_variables()
    for message in config_sources.unknown_variables([i.env for i in option_infos()]):
        say(message, key=message)
    file, file_data = _config_file()
    token = _CONFIG_FILE.set(file)
    try:
        return KVPluginSettings(**given)
    except ValidationError as exc:
        lines = [_describe(e, given, file, file_data) for e in exc.errors()]
        raise SettingsError("kvplugin: " + "; ".join(lines)) from None
    finally:
        _CONFIG_FILE.reset(token)
