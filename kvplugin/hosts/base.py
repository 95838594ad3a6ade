"""What every host adapter shares: version gating, a patch registry that restores, and the
jobs every adapter has (building the session, failing at start-up, the model check, the
active line, the stats report, checking seams).

An adapter *translates* between a host's internals and kvplugin's engine; it never decides
policy (that is :mod:`kvplugin.cache.service.service`). It declares the distribution it patches and
the version range it was proven against (the tox matrix); outside that range it says so
once and patches nothing. Patching is all-or-nothing: if any step fails, every patch
already applied is undone.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from kvplugin.log import say

_MISSING = object()

#: The route every host serves kvplugin's report at.
STATS_PATH = "/kvplugin/stats"


class SeamError(RuntimeError):
    """A seam kvplugin needs is missing or has an unexpected shape (a fork, a new release)."""


def require(ok: bool, what: str) -> None:
    """Fail closed: raise :class:`SeamError` naming the seam unless ``ok``."""
    if not ok:
        raise SeamError(what)


def require_attrs(owner: Any, *names: str) -> None:
    """Every name present on ``owner`` (a module or class of the host)."""
    for name in names:
        require(hasattr(owner, name), f"{_label(owner)}.{name} is missing")


def fail_start(message: str, *, hard: bool = False) -> None:
    """Stop the server at start-up: print ``message`` (it names flag and variable), exit 2.

    ``hard`` (or any thread but the main one): leave at once with ``os._exit``. From inside
    a server's start-up (a generation thread, uvicorn's lifespan) a ``SystemExit`` would be
    caught and turned into a traceback and another exit status; nothing needs cleaning up.
    """
    print(message, file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()
    except Exception:
        pass
    if hard or threading.current_thread() is not threading.main_thread():
        os._exit(2)
    raise SystemExit(2)


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any  # the raw value from owner.__dict__ (staticmethods round-trip), or _MISSING


@dataclass
class PatchRegistry:
    """Records every replaced attribute and puts the exact originals back."""

    patches: list[_Patch] = field(default_factory=list)

    def replace(self, owner: Any, name: str, new: Any) -> Any:
        """Set ``owner.name = new``; return the original as ``getattr`` saw it."""
        raw = vars(owner).get(name, _MISSING)
        if raw is _MISSING and not hasattr(owner, name):
            raise AttributeError(f"{_label(owner)} has no attribute {name!r} to patch")
        current = getattr(owner, name)
        self.patches.append(_Patch(owner, name, raw))
        setattr(owner, name, new)
        return current

    def add(self, owner: Any, name: str, value: Any) -> None:
        """Set a name ``owner`` does not have yet (``restore_all`` deletes it again)."""
        if name in vars(owner):
            raise AttributeError(f"{_label(owner)} already has {name!r}")
        self.patches.append(_Patch(owner, name, _MISSING))
        setattr(owner, name, value)

    def restore_all(self) -> None:
        """Undo in reverse order, restoring identity (``owner.__dict__[name] is original``)."""
        while self.patches:
            p = self.patches.pop()
            if p.original is _MISSING:
                delattr(p.owner, p.name)
            else:
                setattr(p.owner, p.name, p.original)

    def __len__(self) -> int:
        return len(self.patches)


def _label(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))


def installed_version(distribution: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(distribution))
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


class HostAdapter:
    """Base class: subclasses implement :meth:`apply` and name their host once, as
    ``class MyAdapter(HostAdapter, declaration=MY_HOST)`` (a
    :class:`~kvplugin.hostspecs.HostDeclaration`), or set the class attributes themselves."""

    name: ClassVar[str]  # "mlx-lm"
    distribution: ClassVar[str]  # PyPI distribution name
    supported: ClassVar[SpecifierSet]  # proven by the tox matrix
    trigger_module: ClassVar[str]  # the module whose import installs the adapter
    declaration: ClassVar[Any] = None  # the HostDeclaration these were taken from

    def __init_subclass__(cls, declaration: Any = None, **kwargs: Any) -> None:
        """Take the host's identity from its declaration (:mod:`kvplugin.hostspecs`)."""
        super().__init_subclass__(**kwargs)
        if declaration is not None:
            cls.declaration = declaration
            cls.name = declaration.name
            cls.distribution = declaration.distribution
            cls.trigger_module = declaration.trigger_module
            cls.supported = SpecifierSet(declaration.supported)

    def __init__(self) -> None:
        self.registry = PatchRegistry()
        self.installed = False
        self._lock = threading.Lock()

    # -- to implement -------------------------------------------------------------
    def apply(self, module: Any, patches: PatchRegistry) -> None:
        """Patch the host through ``patches``; raise to abort (all is undone)."""
        raise NotImplementedError

    def check_identity(self, module: Any) -> str | None:
        """Return why ``module`` is not the real host (e.g. a fork), or ``None``."""
        return None

    # -- shared ----------------------------------------------------------------------
    def version(self) -> Version | None:
        return installed_version(self.distribution)

    def support_problem(self, module: Any = None) -> str | None:
        """Why this host cannot be patched here, or ``None`` when it can."""
        version = self.version()
        if version is None:
            return f"{self.distribution} is not installed"
        if version not in self.supported:
            return (
                f"{self.distribution} {version} is outside kvplugin's supported range "
                f"{self.supported}"
            )
        return self.check_identity(module) if module is not None else None

    def install(self, module: Any) -> bool:
        """Patch the host once; on an unsupported host or any error, leave it stock.

        Only for the host's shape (a seam missing, a version not known): ``apply`` patches and
        never reads the user's settings, which are resolved and checked later, at start-up,
        where a bad value stops the server (:func:`fail_start`) and is never served around."""
        with self._lock:
            if self.installed:
                return True
            problem = self.support_problem(module)
            if problem is not None:
                say(f"{problem}; {self.name} runs stock", key=f"unsupported:{self.name}")
                return False
            try:
                self.apply(module, self.registry)
            except Exception as exc:
                self.registry.restore_all()
                say(
                    f"could not patch {self.name} ({type(exc).__name__}: {exc}); "
                    f"{self.name} runs stock",
                    key=f"failed:{self.name}",
                )
                return False
            self.installed = True
            return True

    def uninstall(self) -> None:
        with self._lock:
            self.registry.restore_all()
            self.installed = False

    # -- the jobs every adapter has, done one way -------------------------------------------
    def make_session(self, settings: Any, *, max_bytes: int | None,
                     max_entries: int | None) -> Any:
        """The process's :class:`~kvplugin.cache.service.service.KVService`, on the plugin manager's
        hook relay. Raises ``SettingsError`` for every failure: what fails here is the user's
        configuration or a plugin (a plugin refusing it, a tier that cannot be set up), never
        a host seam, so the host stops (exit 2, the message) instead of serving stock."""
        from kvplugin.cache.service.service import KVService
        from kvplugin.plugins import get_plugin_manager
        from kvplugin.settings import SettingsError

        try:
            return KVService(settings, host=self.name, hook=get_plugin_manager().hook,
                             max_bytes=max_bytes, max_entries=max_entries)
        except SettingsError:
            raise
        except Exception as exc:
            raise SettingsError(f"kvplugin: cannot set up the prompt store "
                                f"({type(exc).__name__}: {exc})") from exc

    def model_problem(self, model: Any, settings: Any, given_flags: Any = ()) -> str | None:
        """The session's model check (group size vs head dimension), one message."""
        from kvplugin.cache.service.startup_checks import model_problem

        return model_problem(model, settings, given_flags)

    def say_active(self, session: Any, *, mode: str | None = None) -> None:
        """The one ``kvplugin: active ...`` line, once per process, then one line for each
        setting that changed another's meaning (see :func:`kvplugin.provenance.notices`)."""
        from kvplugin.provenance import notices, setting_sources

        say(session.active_line(self.version(), stats_path=STATS_PATH, mode=mode),
            key=f"{self.name}:active")
        given = getattr(self, "given_flags", None) or {}
        for line in notices(session.settings, setting_sources(given)):
            say(line, key=f"{self.name}:notice:{line}")

    def report(self, session: Any, **host_fields: Any) -> dict:
        """What ``GET /kvplugin/stats`` answers: the session's report and the host version."""
        return session.report(host_version=str(self.version()), **host_fields)


def wraps_original(original: Callable) -> Callable[[Callable], Callable]:
    """``functools.wraps`` that also records the original for introspection."""
    import functools

    def deco(fn: Callable) -> Callable:
        wrapped = functools.wraps(original)(fn)
        wrapped.__kvplugin_original__ = original  # type: ignore[attr-defined]
        return wrapped

    return deco


def config_of(path: str | os.PathLike | None) -> dict | None:
    """``config.json`` of a local model directory or an already cached HF repo (no I/O else).

    Both hosts check the model against the settings from it *before* the server listens:
    the weights load later (in mlx-lm's generation thread, after "Starting httpd").
    """
    if not path:
        return None
    p = Path(str(path)).expanduser()
    cfg = p / "config.json"
    if not cfg.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(str(path), "config.json")
        except Exception:
            found = None
        if not isinstance(found, str):
            return None
        cfg = Path(found)
    try:
        return json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None


def shaping_make_prompt_cache(adapter: Any, original: Callable, key: str) -> Callable:
    """mlx-lm's ``make_prompt_cache`` whose caches the session shapes (``--max-kv-size``,
    growth step); the host's own cache when no session exists yet or shaping fails (said once
    under ``key``)."""

    @wraps_original(original)
    def make_prompt_cache(model: Any, *args: Any, **kwargs: Any) -> list:
        cache = original(model, *args, **kwargs)
        service = adapter.service
        if service is None:  # no session in this process (yet): stock behaviour
            return cache
        try:
            return service.make_cache(model, cache)
        except Exception as exc:
            say(f"could not shape a new cache ({type(exc).__name__}: {exc}); using "
                "mlx-lm's", key=key)
            return cache

    return make_prompt_cache
