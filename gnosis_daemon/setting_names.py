"""How each setting is named where a user sets it, and the error that names it.

The settings object (``gnosis_daemon.settings``) and the checks that live beside their own
concept (``gnosis_daemon.kv_event_keys``) both raise ``SettingsError`` through ``check``, so
every refusal tells the user the flag, the environment variable and the TOML key to fix.

Each field's environment name is ``GNOSIS_<FIELD>`` upper-cased, except the ones in
``ENV_ALIASES`` that the deployed system already uses (``THOTH_LIQUID_MEMORY``).
"""

from __future__ import annotations

from typing import Any

ENV_PREFIX = "GNOSIS_"
ENV_ALIASES = {
    "liquid_memory": "THOTH_LIQUID_MEMORY",
    # systemd's own names (sd_notify(3)): set by systemd for the unit's main process only.
    "notify_socket": "NOTIFY_SOCKET",
    "watchdog_usec": "WATCHDOG_USEC",
}


class SettingsError(ValueError):
    """A setting has a bad value; the message names the setting and how to set it."""


def env_name(name: str) -> str:
    """The environment variable that sets the setting ``name``."""
    if name == "disable_capabilities":
        return "GNOSIS_STATION_DISABLE"
    return ENV_ALIASES.get(name, ENV_PREFIX + name.upper())


def check(value: Any, ok: bool, name: str, expected: str) -> None:
    """Raise ``SettingsError`` for the setting ``name`` = ``value`` unless ``ok``."""
    if not ok:
        raise SettingsError(
            f"setting {name!r} = {value!r} is invalid: expected {expected} "
            f"(set it with --{name.replace('_', '-')}, {env_name(name)}, or '{name}' in the TOML file)"
        )
