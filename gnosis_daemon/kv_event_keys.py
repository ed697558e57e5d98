"""Who may read the KV events: ZMQ CURVE keys, and the refusal to publish them openly.

The events carry the token ids of every tenant's cached prompts (``station.serving.
kv_events``): decoded, they are the prompts' text. So with API keys configured (tenants who
must not read each other's prompts) the station publishes them only where no tenant can
connect, or to clients that prove a key:

- ``kv_events_curve_secret_file``: a ZMQ certificate file with the station's CURVE secret key
  (``zmq.auth.create_certificates`` writes one as ``<name>.key_secret``). With it, the PUB
  socket and the replay socket are CURVE servers, and a ZAP handler lets in only the clients
  whose public key is in ``kv_events_curve_client_keys``;
- ``kv_events_curve_client_keys``: comma-separated, each a Z85 public key (40 characters) or
  the path of a public certificate file (``<name>.key``) or of a directory of them.

``check`` (``Settings.__post_init__``) refuses, at start: API keys with an endpoint a remote
peer can reach (anything but ``ipc://``, ``tcp://127.x.x.x``, ``tcp://[::1]``,
``tcp://localhost``) and no CURVE secret; a secret without client keys (any client could
connect) or client keys without a secret; a file or key that does not load. pyzmq is
imported only when CURVE is configured.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gnosis_daemon.setting_names import SettingsError, env_name
from gnosis_daemon.setting_names import check as check_setting

ZAP_DOMAIN = "gnosis-kv-events"
_Z85_KEY_CHARS = 40


@dataclass(frozen=True)
class CurveKeys:
    """The station's CURVE key pair and the client public keys it accepts (all Z85 bytes)."""

    public: bytes
    secret: bytes
    clients: frozenset[bytes]


def is_loopback(endpoint: str) -> bool:
    """Whether only this machine can connect to ``endpoint`` once bound (an ``ipc://`` path,
    or a TCP address on loopback). Wildcards and interface names are not."""
    if not endpoint or endpoint.startswith("ipc://"):
        return True
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check(settings: Any) -> None:
    """Raise ``SettingsError`` for a KV events configuration that would leak prompts or
    that cannot be loaded (see the module docstring)."""
    host = settings.kv_events_advertise_host
    check_setting(host, not set("/@ :[]") & set(host), "kv_events_advertise_host",
                  "empty or a host name (no scheme or port)")
    secret, clients = settings.kv_events_curve_secret_file, settings.kv_events_curve_client_keys
    if bool(secret) != bool(clients.strip()):
        given, missing = (("kv_events_curve_secret_file", "kv_events_curve_client_keys")
                          if secret else
                          ("kv_events_curve_client_keys", "kv_events_curve_secret_file"))
        raise SettingsError(f"setting {given!r} is set but {missing!r} is not "
                            f"({env_name(missing)}): KV events CURVE needs the station's "
                            "secret key and the public keys of the clients it lets in")
    if secret:
        load_curve_keys(settings)  # raises SettingsError naming what does not load
        return
    keyed = bool(settings.api_key_list) or settings.api_keys_file is not None
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        endpoint = getattr(settings, name)
        if keyed and not is_loopback(endpoint):
            raise SettingsError(
                f"setting {name!r} = {endpoint!r} is refused: with API keys configured the KV "
                "events carry every tenant's prompt tokens, and this endpoint can be reached "
                "from other machines without credentials. Bind it to loopback (e.g. "
                "tcp://127.0.0.1:5557, the router beside the daemon) or set "
                "kv_events_curve_secret_file and kv_events_curve_client_keys "
                "(docs/deploy.md, \"Routing without a session key\")")


def load_curve_keys(settings: Any) -> CurveKeys | None:
    """The configured CURVE keys, or None when CURVE is off; ``SettingsError`` when a file
    or key does not load."""
    path = settings.kv_events_curve_secret_file
    if not path:
        return None
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SettingsError(f"setting 'kv_events_curve_secret_file' = {path!r}: cannot load a "
                            f"ZMQ certificate: {exc}") from None
    if not secret or not _is_key(public) or not _is_key(secret):
        raise SettingsError(f"setting 'kv_events_curve_secret_file' = {path!r}: the file holds "
                            "no CURVE secret key (it is the public half: use <name>.key_secret)")
    clients: set[bytes] = set()
    for entry in (e.strip() for e in settings.kv_events_curve_client_keys.split(",")):
        if entry:
            clients |= _client_keys(entry)
    if not clients:
        raise SettingsError("setting 'kv_events_curve_client_keys' names no public key")
    return CurveKeys(public, secret, frozenset(clients))


def _client_keys(entry: str) -> set[bytes]:
    import zmq.auth

    if len(entry) == _Z85_KEY_CHARS and not Path(entry).exists():
        if not _is_key(entry.encode()):
            raise SettingsError(f"setting 'kv_events_curve_client_keys': {entry!r} is not a "
                                "Z85 CURVE public key")
        return {entry.encode()}
    path = Path(entry)
    try:
        if path.is_dir():
            keys = set(zmq.auth.load_certificates(path))
        else:
            keys = {zmq.auth.load_certificate(path)[0]}
    except (OSError, ValueError) as exc:
        raise SettingsError(f"setting 'kv_events_curve_client_keys': {entry!r} is neither a "
                            f"Z85 public key nor a loadable certificate: {exc}") from None
    bad = [k for k in keys if not _is_key(k)]
    if bad or not keys:
        raise SettingsError(f"setting 'kv_events_curve_client_keys': {entry!r} holds no valid "
                            "CURVE public key")
    return keys


def _is_key(key: bytes | None) -> bool:
    if not key or len(key) != _Z85_KEY_CHARS:
        return False
    from zmq.utils import z85

    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError, IndexError, TypeError):
        return False
