"""CURVE on the KV events' sockets (``gnosis_daemon.kv_event_keys`` reads the keys).

``secure`` makes a socket a CURVE server under the ZAP domain ``ZAP_DOMAIN`` before it is
bound; ``start_authenticator`` starts pyzmq's ``ThreadAuthenticator`` on the publisher's
context, with a callback that lets in exactly the configured client public keys. The
authenticator must run before the first bind: a CURVE socket whose context has no ZAP
handler accepts every client that knows the server's public key. A refused client's
handshake fails, so it never receives a message (PUB) nor gets a request through (replay
ROUTER); refusals are counted and logged (``kv_events_client_refused``, with the key).
"""

from __future__ import annotations

import time
from typing import Any

from gnosis_daemon.kv_event_keys import ZAP_DOMAIN, CurveKeys
from gnosis_daemon.logs import get_logger

log = get_logger(__name__)


class _AllowedKeys:
    """pyzmq's credentials provider: ``callback(domain, z85 key) -> bool``. Refusals are
    counted and logged at most once every ``LOG_EVERY_S`` (a peer retrying its handshake
    in a loop must not flood the log)."""

    LOG_EVERY_S = 10.0

    def __init__(self, keys: CurveKeys) -> None:
        self._clients = keys.clients
        self.refused = 0
        self._logged_at = -self.LOG_EVERY_S

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = domain == ZAP_DOMAIN and key in self._clients
        if not allowed:
            self.refused += 1
            now = time.monotonic()
            if now - self._logged_at >= self.LOG_EVERY_S:
                self._logged_at = now
                log.warning("kv_events_client_refused", refused=self.refused,
                            client_key=key.decode(errors="replace"))
        return allowed


def start_authenticator(ctx: Any, keys: CurveKeys) -> Any:
    """The running ZAP handler of ``ctx`` (stop it before the context is terminated)."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowedKeys(keys))
    return auth


def secure(sock: Any, keys: CurveKeys) -> None:
    """Make ``sock`` (not yet bound) a CURVE server that asks the ZAP handler."""
    import zmq

    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
