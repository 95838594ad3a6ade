"""Every built-in host, declared once: the one place a host's facts are written down.

Why one module, and why stdlib only: the ``.pth`` bootstrap derives its trigger modules
from these declarations at every interpreter start, so importing this module must cost
next to nothing (no ``packaging``, no ``importlib.metadata``, and not the
``kvplugin.hosts`` package, which a plain ``python -c pass`` must never import).
Everything else that needs a host's facts reads them from here:

* the adapters (``kvplugin.hosts.*``) take their name, distribution, trigger module and
  supported range from their declaration;
* ``kvplugin info`` and ``kvplugin.hosts.get_adapter`` list the ``kvplugin.hosts``
  entry-point group, which pyproject fills with :attr:`HostDeclaration.adapter`;
* the tools (demo, benchmarks, server harness, integration tests) launch a host with
  :attr:`~HostDeclaration.console_script` and :attr:`~HostDeclaration.launch`;
* ``tests/test_hostspecs.py`` checks that pyproject's extras, the ``kvplugin.hosts``
  entry points and ``tox.ini`` agree with :attr:`~HostDeclaration.supported` and
  :attr:`~HostDeclaration.tested`.

A server kvplugin recognizes but does not back (rapid-mlx) is an :class:`UnsupportedHost`:
the bootstrap triggers on it too, its adapter only says that the server runs stock, and
:data:`KNOWN_HOSTS` is both kinds.

A third host shipped as its own plugin declares itself the same way in its own package,
lists its adapter under the ``kvplugin.hosts`` entry-point group, and activates its
trigger from its own ``.pth`` with :func:`kvplugin._bootstrap.register`.
"""

from __future__ import annotations

# A plain class, not a dataclass or NamedTuple: ``dataclasses`` and ``typing`` cost ~25 ms
# of imports at every interpreter start, five times the bootstrap's whole budget.


class HostDeclaration:
    """What kvplugin knows about one host, independent of its code."""

    __slots__ = ("name", "distribution", "supported", "trigger_module", "adapter", "label",
                 "console_script", "launch", "module_launch", "request_needs_model",
                 "budget_args", "launch_env", "install", "extra_requires_host", "tox_prefix",
                 "tested", "also_triggers")

    def __init__(
        self,
        *,
        name: str,
        distribution: str,
        supported: str,
        trigger_module: str,
        adapter: str,
        label: str,
        console_script: str,
        launch: tuple[str, ...],
        module_launch: tuple[str, ...] | None = None,
        request_needs_model: bool = False,
        budget_args: tuple[str, ...] = (),
        launch_env: dict[str, str] | None = None,
        install: str = "",
        extra_requires_host: bool = True,
        tox_prefix: str = "",
        tested: tuple[str, ...] = (),
        also_triggers: tuple[str, ...] = (),
    ) -> None:
        # "mlx-lm": the adapter's, the CLI's (--host) and the pip extra's name
        self.name = name
        self.distribution = distribution  # the PyPI distribution that ships the host
        # PEP 440 specifier proven by the tox matrix (the adapter gates on it)
        self.supported = supported
        self.trigger_module = trigger_module  # the host module whose import installs us
        # "module:attribute" of the adapter singleton; the module has on_import(module)
        self.adapter = adapter
        self.label = label  # how a user starts it, for messages: "mlx_lm.server"
        self.console_script = console_script  # the host's command, next to sys.executable
        # Arguments after the console script; {model}, {host}, {port} and
        # {served_model_name} are filled in by the launcher (kvplugin.tools.hostcmd).
        self.launch = launch
        # ``python -m <these>`` starts the host like its console script (None: no such form)
        self.module_launch = module_launch
        # True: a request must name the model ({served_model_name}); False: the server's
        # default model answers a request without "model".
        self.request_needs_model = request_needs_model
        self.budget_args = budget_args  # prompt-cache byte budget flags; {bytes}, {mb}
        self.launch_env = dict(launch_env or {})  # set for every launch by the tools
        self.install = install  # the documented install command
        # The pip extra named ``name`` requires ``distribution`` with exactly ``supported``
        # (False: the host is installed on its own with --no-deps; see ``install``).
        self.extra_requires_host = extra_requires_host
        self.tox_prefix = tox_prefix  # tox env "<prefix>-<version digits>" per tested version
        self.tested = tested  # the versions the tox matrix runs
        # More host modules whose import calls the adapter's on_import(module): a command-line
        # module that finishes importing only after the trigger module it imports
        self.also_triggers = also_triggers

    def __repr__(self) -> str:
        return f"HostDeclaration(name={self.name!r}, supported={self.supported!r})"

    @property
    def adapter_module(self) -> str:
        return self.adapter.partition(":")[0]

    def tox_envs(self) -> list[str]:
        return [f"{self.tox_prefix}-{''.join(v.split('.'))}" for v in self.tested]


MLX_LM = HostDeclaration(
    name="mlx-lm",
    distribution="mlx-lm",
    supported=">=0.31.3,<0.33",
    trigger_module="mlx_lm.server",
    adapter="kvplugin.hosts.mlx_lm:ADAPTER",
    label="mlx_lm.server",
    console_script="mlx_lm.server",
    launch=("--model", "{model}", "--host", "{host}", "--port", "{port}"),
    # `python -m mlx_lm server` imports mlx_lm.server as a module, like the console script
    module_launch=("mlx_lm", "server"),
    budget_args=("--prompt-cache-bytes", "{bytes}", "--prompt-cache-size", "1000"),
    install='pip install "kvplugin[mlx-lm]"',
    tox_prefix="mlxlm",
    tested=("0.31.3", "0.32.0", "0.32.1", "0.32.2"),
)

VLLM_MLX = HostDeclaration(
    name="vllm-mlx",
    distribution="vllm-mlx",
    supported=">=0.5.0,<0.7",
    trigger_module="vllm_mlx.cli",
    adapter="kvplugin.hosts.vllm_mlx:ADAPTER",
    label="vllm-mlx serve",
    console_script="vllm-mlx",
    launch=("serve", "{model}", "--host", "{host}", "--port", "{port}", "--offline",
            "--served-model-name", "{served_model_name}"),
    request_needs_model=True,
    budget_args=("--cache-memory-mb", "{mb}"),
    # simple mode answers 503 to a request that arrives while another runs, unless told to wait
    launch_env={"VLLM_MLX_SIMPLE_ENGINE_LOCK_ADMISSION": "wait"},
    install='pip install "kvplugin[vllm-mlx]" && pip install --no-deps "vllm-mlx==0.6.0"',
    # vllm-mlx declares torch, gradio and opencv (GBs of CUDA wheels on Linux), none of
    # which its text serve path needs: the extra installs its real needs, the host comes
    # with --no-deps.
    extra_requires_host=False,
    tox_prefix="vllm",
    tested=("0.5.0", "0.6.0"),
)

MLX_OPENAI_SERVER = HostDeclaration(
    name="mlx-openai-server",
    distribution="mlx-openai-server",
    supported=">=1.8.1,<1.9",
    # Imported in both of its processes: the server (through app.cli / app.main) and the
    # spawned child that runs the model (its worker imports it by name).
    trigger_module="app.server",
    also_triggers=("app.cli",),  # the `launch` command, defined after app.server is imported
    adapter="kvplugin.hosts.mlx_openai_server:ADAPTER",
    label="mlx-openai-server launch",
    console_script="mlx-openai-server",
    launch=("launch", "--model-path", "{model}", "--model-type", "lm", "--host", "{host}",
            "--port", "{port}", "--served-model-name", "{served_model_name}", "--no-log-file"),
    request_needs_model=True,
    budget_args=("--max-bytes", "{bytes}", "--prompt-cache-size", "1000"),
    install='pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && '
            'pip install "kvplugin[mlx-openai-server]" && '
            'pip install --no-deps outlines==1.1.1 "mlx-openai-server==1.8.1"',
    # It declares torch (through outlines), torchvision, mlx-vlm, mflux and audio packages;
    # its text path needs only outlines' import of torch, from a CPU-only wheel.
    extra_requires_host=False,
    tox_prefix="oai",
    tested=("1.8.1",),
)

BUILTIN_HOSTS: tuple[HostDeclaration, ...] = (MLX_LM, VLLM_MLX, MLX_OPENAI_SERVER)


class UnsupportedHost:
    """A server kvplugin recognizes and never patches: at start-up it says, in one line,
    that the server runs stock (silence would look like kvplugin working).

    Declared here, beside the backed hosts, so that the bootstrap triggers on it,
    ``kvplugin info`` lists it (``supported range: none``) and the tox matrix proves the
    line on its real server.
    """

    __slots__ = ("name", "distribution", "trigger_module", "adapter", "console_script",
                 "launch", "launch_env", "tox_prefix", "tested")

    def __init__(self, *, name: str, distribution: str, trigger_module: str, adapter: str,
                 console_script: str, launch: tuple[str, ...],
                 launch_env: dict[str, str] | None = None, tox_prefix: str = "",
                 tested: tuple[str, ...] = ()) -> None:
        self.name = name
        self.distribution = distribution
        # a module every server start-up of the host imports (its --help need not)
        self.trigger_module = trigger_module
        self.adapter = adapter  # "module:attribute"; the module has on_import(module)
        self.console_script = console_script
        self.launch = launch  # as HostDeclaration.launch (the integration test starts it)
        self.launch_env = dict(launch_env or {})
        self.tox_prefix = tox_prefix
        self.tested = tested  # the versions whose start-up line the tox matrix proves

    def __repr__(self) -> str:
        return f"UnsupportedHost(name={self.name!r})"

    @property
    def adapter_module(self) -> str:
        return self.adapter.partition(":")[0]

    def tox_envs(self) -> list[str]:
        return [f"{self.tox_prefix}-{''.join(v.split('.'))}" for v in self.tested]


RAPID_MLX = UnsupportedHost(
    name="rapid-mlx",
    distribution="rapid-mlx",
    # A vllm-mlx fork: its own `vllm-mlx` script runs rapid_mlx.cli, never vllm_mlx.cli, and
    # its `vllm_mlx` package is a redirect to rapid_mlx. Every way it serves (`vllm-mlx
    # serve`, `rapid-mlx serve`, `python -m rapid_mlx.server`) imports rapid_mlx.server.
    # Releases 0.14.2 and earlier ship the real package as `vllm_mlx`: the vllm-mlx adapter
    # finds them by file ownership and says this host's line.
    trigger_module="rapid_mlx.server",
    adapter="kvplugin.hosts.unsupported:RAPID_MLX",
    console_script="vllm-mlx",
    launch=("serve", "{model}", "--host", "{host}", "--port", "{port}",
            "--served-model-name", "{served_model_name}"),
    # no usage reporting, no release check: nothing leaves the machine
    launch_env={"RAPID_MLX_TELEMETRY": "0", "RAPID_MLX_DISABLE_VERSION_CHECK": "1"},
    tox_prefix="rapid",
    tested=("0.16.10",),
)

UNSUPPORTED_HOSTS: tuple[UnsupportedHost, ...] = (RAPID_MLX,)

#: Every host the bootstrap triggers on and ``kvplugin info`` lists.
KNOWN_HOSTS: tuple[HostDeclaration | UnsupportedHost, ...] = BUILTIN_HOSTS + UNSUPPORTED_HOSTS


def declaration(name: str) -> HostDeclaration:
    """The built-in declaration called ``name``; KeyError names the known ones."""
    for decl in BUILTIN_HOSTS:
        if decl.name == name:
            return decl
    raise KeyError(f"no built-in host {name!r} (known: {', '.join(host_names())})")


def host_names() -> tuple[str, ...]:
    return tuple(decl.name for decl in BUILTIN_HOSTS)
