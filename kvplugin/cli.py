"""``kvplugin`` command line: ``info`` (and, from later issues, ``demo`` and ``bench``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import kvplugin
from kvplugin.options import add_options, given_flags
from kvplugin.settings import SettingsError, option_infos, resolve_settings, setting_sources


def cmd_info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvplugin.hosts import all_adapters
    from kvplugin.plugins import list_plugins

    flags = given_flags(parser, args)
    try:
        settings = resolve_settings(flags)
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    sources = setting_sources(flags)

    print(f"kvplugin {kvplugin.__version__}")
    print("\nhosts:")
    for adapter in all_adapters():
        version = adapter.version()
        if version is None:
            state = "not installed"
        elif version in adapter.supported:
            state = f"{version} (supported)"
        else:
            state = f"{version} (UNSUPPORTED: runs stock)"
        print(f"  {adapter.name:<10} {state:<32} supported range: {adapter.supported}")
    print("\nplugins:")
    for plugin in list_plugins():
        print(f"  {plugin.name:<20} {plugin.origin}")
    print("\nsettings (flag > env > default):")
    for info in option_infos():
        value = getattr(settings, info.field)
        print(f"  {info.flag:<36} {value!s:<12} [{sources[info.field]}]  {info.env}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplugin", description=__doc__)
    parser.add_argument("--version", action="version", version=kvplugin.__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="version, hosts, plugins and resolved settings")
    add_options(info)
    info.set_defaults(func=cmd_info, subparser=info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
