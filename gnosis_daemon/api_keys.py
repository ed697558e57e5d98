"""API keys and tenants.

With ``api_keys`` or ``api_keys_file`` set, every ``/v1`` route needs ``Authorization: Bearer
<key>`` (``/health`` and ``/metrics`` too with ``health_requires_key``), and the key names the
caller's tenant: the name written after it in the keys file, else a hash of the key
(``tenant_key``). Without keys the daemon serves one local user: every caller is
the one tenant ``anon``, whatever ``Authorization`` header it sends.

A presented key is checked against every configured key, always all of them, by comparing
fixed-length SHA-256 digests with ``hmac.compare_digest``: neither the time taken nor an
early exit tells a caller how close its guess was, or which key matched.

The keys file: one key a line, optionally followed by whitespace and a tenant name; blank
lines and lines starting with ``#`` are ignored. A file that cannot be read or has a bad line
raises ``KeyFileError`` naming the line, so the host refuses to start rather than serve
with fewer keys than the operator wrote.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from gnosis_daemon.settings import Settings

ANON = "anon"  # the one tenant of a daemon without keys

# Tenant names appear in KV-session ids and logs: keep them short and plain.
_TENANT_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A bearer token is one header token: printable ASCII, no whitespace.
_KEY = re.compile(r"^[\x21-\x7e]+$")


def tenant_key(api_key: str | None) -> str:
    """The tenant a key names when the keys file gives it no name: a short hash of it."""
    if not api_key:
        return ANON
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


class KeyFileError(ValueError):
    """The API keys file is unreadable or malformed; the message names the file and line."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class Keyring:
    """The configured keys (as digests) and the tenant each one names."""

    entries: tuple[tuple[bytes, str], ...] = ()
    probe_key: str | None = None  # one configured key, for the supervisor's /health probe

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    def tenant(self, presented: str | None) -> str | None:
        """The tenant of ``presented``, or ``None`` when it matches no configured key.
        Without keys configured every caller is the one tenant ``anon``."""
        if not self.entries:
            return ANON
        given = _digest(presented or "")
        found: str | None = None
        for digest, tenant in self.entries:
            # No early exit: every key is compared whatever the outcome.
            if hmac.compare_digest(digest, given):
                found = tenant
        return found


def parse_key_file(text: str, source: str) -> list[tuple[str, str | None]]:
    """``(key, tenant name or None)`` for every key line of a keys file."""
    keys: list[tuple[str, str | None]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        where = f"{source} line {number}"
        if len(fields) > 2:
            raise KeyFileError(f"{where}: expected a key optionally followed by one tenant name, "
                               f"got {len(fields)} fields")
        if not _KEY.match(fields[0]):
            raise KeyFileError(f"{where}: a key must be printable ASCII without spaces")
        tenant = fields[1] if len(fields) == 2 else None
        if tenant is not None and not _TENANT_NAME.match(tenant):
            raise KeyFileError(f"{where}: tenant name must be 1-64 characters of A-Z, a-z, 0-9, "
                               f"'_' or '-'")
        keys.append((fields[0], tenant))
    return keys


def load_keyring(settings: Settings) -> Keyring:
    """Every key of ``api_keys`` and ``api_keys_file``; raises ``KeyFileError`` on a bad file."""
    pairs: list[tuple[str, str | None]] = [(key, None) for key in settings.api_key_list]
    for key, _ in pairs:
        if not _KEY.match(key):
            raise KeyFileError("setting 'api_keys': a key must be printable ASCII without "
                               "spaces")
    if settings.api_keys_file is not None:
        path = Path(settings.api_keys_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"api_keys_file {str(path)!r} cannot be read: {exc}") from None
        from_file = parse_key_file(text, f"api_keys_file {str(path)!r}")
        if not from_file:
            # An empty file would silently leave the API open, or closed to everyone.
            raise KeyFileError(f"api_keys_file {str(path)!r} holds no keys")
        pairs += from_file
    tenants: dict[str, str] = {}
    for key, name in pairs:
        tenant = name or tenant_key(key)
        if tenants.setdefault(key, tenant) != tenant:
            raise KeyFileError(f"an API key is configured twice with different tenants "
                               f"({tenants[key]!r} and {tenant!r})")
    entries = tuple((_digest(key), tenant) for key, tenant in tenants.items())
    return Keyring(entries, next(iter(tenants), None))


def bearer(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, else ``None``."""
    scheme, _, key = (authorization or "").strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None
