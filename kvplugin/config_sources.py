"""Where settings come from besides flags: the environment and one TOML file.

Kept apart from :mod:`kvplugin.settings` (the model and its rules) because these are the
parts that read the outside world: which configuration file applies, which ``KVPLUGIN_*``
variables exist and whether a boolean variable is spelled in a way we accept.

One file at most is read, the first of:

1. ``$KVPLUGIN_CONFIG`` (an explicit path; missing is an error, never a silent default);
2. ``./kvplugin.toml``;
3. ``./pyproject.toml``, only when it has a ``[tool.kvplugin]`` table;
4. ``$XDG_CONFIG_HOME/kvplugin/kvplugin.toml`` (``~/.config/kvplugin/kvplugin.toml``).

The working directory comes first because a server is usually started from its project;
the per-user file last, as the machine-wide habit a project may override.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

ENV_PREFIX = "KVPLUGIN_"
CONFIG_ENV = "KVPLUGIN_CONFIG"
PYPROJECT_TABLE = ("tool", "kvplugin")

# Variables that are not options but still kvplugin's (documented in docs/configuration.md).
PROCESS_VARIABLES = {
    "KVPLUGIN_DISABLE": "switch kvplugin off: the host runs stock",
    "KVPLUGIN_BLOCK_PLUGINS": "plugin names not to load",
    "KVPLUGIN_CONFIG": "path of the configuration file",
    "KVPLUGIN_HOME": "where kvplugin builds its local models",
}
# Prefixes reserved for kvplugin's own test-suite and tooling knobs.
RESERVED_PREFIXES = ("KVPLUGIN_TEST_",)

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})
BOOL_WORDS = "true/false, 1/0, yes/no, on/off"


class ConfigFileError(ValueError):
    """The configuration file is missing, unreadable or not valid TOML."""


@dataclass(frozen=True)
class ConfigFile:
    """The one configuration file that applies, and the table of it kvplugin reads."""

    path: Path
    table: tuple[str, ...]  # () for kvplugin.toml, ("tool", "kvplugin") for pyproject
    variable: str = ""  # the variable that named it (KVPLUGIN_CONFIG), if one did

    def read(self) -> dict:
        """The kvplugin table as a dict (parse errors name the file, and the variable)."""
        try:
            with self.path.open("rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            named = f" ({self.variable})" if self.variable else ""
            raise ConfigFileError(f"cannot read {self.path}{named}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigFileError(f"{self.path} is not valid TOML: {exc}") from None
        for key in self.table:
            data = data.get(key, {})
            if not isinstance(data, dict):
                raise ConfigFileError(f"[{'.'.join(self.table)}] in {self.path} is not a table")
        return data

    def describe(self) -> str:
        return f"{self.path} [{'.'.join(self.table)}]" if self.table else str(self.path)


def _has_table(path: Path, table: tuple[str, ...]) -> bool:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError):
        return False  # a broken pyproject is the project's business, not ours
    for key in table:
        if not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return isinstance(data, dict)


def find_config_file(cwd: Path | None = None) -> ConfigFile | None:
    """The configuration file that applies now (see the module docstring), or None."""
    explicit = os.environ.get(CONFIG_ENV, "").strip()
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            why = "a directory, not a file" if path.is_dir() else "no such file"
            raise ConfigFileError(f"{CONFIG_ENV}={explicit!r}: {why}")
        table = PYPROJECT_TABLE if path.name == "pyproject.toml" else ()
        return ConfigFile(path, table, CONFIG_ENV)
    here = Path.cwd() if cwd is None else cwd
    if (here / "kvplugin.toml").is_file():
        return ConfigFile(here / "kvplugin.toml", ())
    if (here / "pyproject.toml").is_file() and _has_table(here / "pyproject.toml", PYPROJECT_TABLE):
        return ConfigFile(here / "pyproject.toml", PYPROJECT_TABLE)
    xdg = os.environ.get("XDG_CONFIG_HOME")
    user = (Path(xdg).expanduser() if xdg else Path.home() / ".config") / "kvplugin" / "kvplugin.toml"
    if user.is_file():
        return ConfigFile(user, ())
    return None


def closest(name: str, candidates: list[str]) -> str | None:
    """The candidate a typo most likely meant (for 'did you mean' hints)."""
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_variables(option_envs: list[str]) -> list[str]:
    """One message per ``KVPLUGIN_*`` variable that names no option or process variable."""
    known = set(option_envs) | set(PROCESS_VARIABLES)
    messages = []
    for name in sorted(os.environ):
        if not name.startswith(ENV_PREFIX) or name in known or name.startswith(RESERVED_PREFIXES):
            continue
        hint = closest(name, sorted(known))
        messages.append(
            f"unknown variable {name} is ignored" + (f" (did you mean {hint}?)" if hint else "")
        )
    return messages


def parse_bool_word(raw: str) -> bool | None:
    """True/False for an accepted spelling, None for anything else ("maybe", "2", "y")."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    return None


def bool_variable(name: str) -> bool:
    """A process-level boolean variable; unset or empty is False; a bad spelling raises."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return False
    value = parse_bool_word(raw)
    if value is None:
        raise ValueError(f"{name}={raw!r} is not a boolean (allowed: {BOOL_WORDS})")
    return value
