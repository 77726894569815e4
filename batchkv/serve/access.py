"""Who may talk to the server: the `Access` rules and the checks the `Guard` middleware applies
(argparse and the server's options read them without the HTTP stack: no starlette here)."""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Access:
    """Access rules. `api_key` None: no key. `allowed_hosts` None: any Host header (names are
    compared without the port, case-insensitively). `allowed_origins`: CORS origins (none: no
    CORS headers at all)."""

    api_key: str | None = None
    public_metrics: bool = False
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()


def key_matches(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries `Bearer <key>`; constant time in the key's bytes."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        given = ""
    return hmac.compare_digest(given.strip().encode(), key.encode())


def host_name(host: str) -> str:
    """A Host header's name without its port, lowercased: `[::1]:8000` -> `::1`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def loopback_hosts(bound: str) -> tuple[str, ...]:
    """The Host names a server bound to the loopback address `bound` answers to by default."""
    return tuple(dict.fromkeys([*LOOPBACK_NAMES, host_name(bound)]))


def is_loopback(address: str) -> bool:
    """Whether a bound (numeric) address is a loopback one."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return address == "localhost"
