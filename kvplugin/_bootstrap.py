"""Activation at interpreter start, run from ``kvplugin.pth`` (and ``kvplugin.start``).

Stdlib only and nearly free: it puts one finder at the front of ``sys.meta_path`` that
reacts to exactly the host modules in :data:`TRIGGERS`, derived from the host declarations
in :mod:`kvplugin.hostspecs` (itself stdlib only; scanning entry points here would cost
more than the whole start-up budget). When one of them finishes
executing, the matching adapter in :mod:`kvplugin.hosts` is imported and installed. Any
error there is caught and reported once; the host's import never fails because of us.

A host shipped as its own plugin activates its trigger from its own ``.pth`` file with one
line, ``import kvplugin._bootstrap as b; b.register("its_host.server", "its_plugin.adapter")``
(see :func:`register`).

``KVPLUGIN_DISABLE`` (1/true/yes/on) switches patching off: nothing of kvplugin beyond
this module is imported, and a host import only prints one line saying the host runs
stock, so a user who forgot the variable is not left guessing.
"""

from __future__ import annotations

import os
import sys

from kvplugin.hostspecs import KNOWN_HOSTS, UNSUPPORTED_HOSTS

# host module -> adapter module (with an ``on_import(module)`` function)
TRIGGERS: dict[str, str] = {
    module: decl.adapter_module
    for decl in KNOWN_HOSTS
    for module in (decl.trigger_module, *getattr(decl, "also_triggers", ()))
}
# trigger modules of hosts kvplugin recognizes and never patches: ``python -m`` runs their own
# code, after the start-up line
STOCK_MAIN: set[str] = {decl.trigger_module for decl in UNSUPPORTED_HOSTS}

_TRUE = {"1", "true", "yes", "on"}


def disabled() -> bool:
    return os.environ.get("KVPLUGIN_DISABLE", "").strip().lower() in _TRUE


class _TriggerLoader:
    """Wraps a host module's loader to run the adapter after the module body."""

    def __init__(self, loader, adapter: str) -> None:
        self._loader = loader
        self._adapter = adapter

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        run_trigger(self._adapter, module)

    def get_code(self, fullname):
        """Only runpy asks for the code: ``python -m <host module>`` runs it as ``__main__``,
        where it would call its ``main()`` before any trigger could patch it.

        So ``__main__`` gets a two-line stand-in instead: import the host module the normal
        way (the trigger patches it, exactly as for the console script) and call its
        ``main()``, which is what the module's own ``if __name__ == "__main__"`` does. A
        module without a ``main()`` runs its own code, stock, and says so once.

        A host kvplugin never patches (:data:`STOCK_MAIN`) runs its own code as ``__main__``
        (its ``if __name__ == "__main__"`` may call something else than ``main()``), after
        its adapter has said the start-up line.
        """
        if fullname in STOCK_MAIN:
            import types

            run_trigger(self._adapter, types.ModuleType(fullname))
            return self._loader.get_code(fullname)
        if disabled():
            return self._loader.get_code(fullname)
        source = (
            "import kvplugin._bootstrap as _kvplugin_bootstrap\n"
            f"_kvplugin_bootstrap.run_as_main({fullname!r}, globals())\n"
        )
        return compile(source, f"<kvplugin: python -m {fullname}>", "exec")


def run_as_main(fullname: str, namespace: dict) -> None:
    """``python -m <host module>`` with kvplugin: the patched module's ``main()``."""
    import importlib
    import importlib.util

    module = importlib.import_module(fullname)
    main = getattr(module, "main", None)
    if callable(main):
        result = main()
        if isinstance(result, int) and result:
            raise SystemExit(result)
        return
    from kvplugin.log import say

    say(f"`python -m {fullname}`: the module has no main(); the host runs stock", key="runpy")
    spec = importlib.util.find_spec(fullname)
    loader = getattr(spec, "loader", None)
    loader = getattr(loader, "_loader", loader)  # past our own wrapper: the module's code
    code = loader.get_code(fullname) if loader is not None else None
    if code is not None:
        exec(code, namespace)


class _TriggerFinder:
    """A meta-path finder that only ever answers for the trigger modules."""

    _kvplugin_trigger_finder = True

    def find_spec(self, fullname, path=None, target=None):
        adapter = TRIGGERS.get(fullname)
        if adapter is None:
            return None
        for finder in sys.meta_path:
            if finder is self or getattr(finder, "_kvplugin_trigger_finder", False):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _TriggerLoader(spec.loader, adapter)
                return spec
        return None


def run_trigger(adapter: str, module) -> None:
    """Install the adapter for a freshly imported host module; never raise."""
    try:
        if disabled():
            if _spawned_child():  # its parent process said it already
                return
            from kvplugin.log import say

            say(f"disabled by KVPLUGIN_DISABLE; {module.__name__} runs stock", key="disabled")
            return
        import importlib

        importlib.import_module(adapter).on_import(module)
    except Exception as exc:  # the host must keep working without us
        try:
            from kvplugin.log import say

            say(f"not active ({type(exc).__name__}: {exc}); the host runs stock", key="error")
        except Exception:
            pass


def _spawned_child() -> bool:
    """A ``multiprocessing`` child (its name is set before it imports its parent's modules)."""
    process = sys.modules.get("multiprocessing.process")
    return process is not None and process.current_process().name != "MainProcess"


def _active() -> bool:
    return any(getattr(f, "_kvplugin_trigger_finder", False) for f in sys.meta_path)


def register(trigger_module: str, adapter_module: str) -> None:
    """Make ``import trigger_module`` call ``adapter_module.on_import(module)``.

    For a third-party host plugin, from its own ``.pth`` (which may run before or after
    kvplugin's: ``.pth`` files run in name order, and the finder reads :data:`TRIGGERS` on
    every lookup). A host module already imported is handed over at once.
    """
    TRIGGERS[trigger_module] = adapter_module
    module = sys.modules.get(trigger_module)
    if module is not None and _active():
        run_trigger(adapter_module, module)


def activate() -> None:
    """Install the trigger finder once (a site dir listed twice runs the .pth twice)."""
    if _active():
        return
    sys.meta_path.insert(0, _TriggerFinder())
    for name, adapter in TRIGGERS.items():  # a host imported before site ran (rare)
        module = sys.modules.get(name)
        if module is not None:
            run_trigger(adapter, module)
