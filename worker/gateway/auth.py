"""The gateway's API keys: bearer keys from the settings, checked in constant time.

``CHATSTREAM_GATEWAY_API_KEYS`` is a comma-separated list; an entry is a key or
``sha256:<64 hex digits>``, the SHA-256 of a key (so the key itself need not be stored),
either optionally after a tenant name and ``=`` (``acme=sk-...``, ``acme=sha256:...``): the
jobs of that key belong to that tenant (docs/gateway.md), else to the tenant named by the
key's id. A key that itself holds ``=`` after a name-like start is given as its ``sha256:``.
Every key is kept only as its digest: a presented key is hashed and compared with every
configured digest by ``hmac.compare_digest``, without stopping at the first match.

A key's *id* (``k`` + the first 16 hex digits of its digest) names it where the gateway
must record who did what: the owner of a job (in the job's metadata) and the rate limiter's
Redis key. It is not the key and cannot be turned back into it.

Browsers' ``EventSource`` cannot send an ``Authorization`` header, so the owner of a job
also gets an *events token* for it: an HMAC of the job id under the key's digest. It opens
that one job's events stream and nothing else, and dies with the key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass

from pydantic import SecretStr

from worker.errors import ConfigError

_HASHED = re.compile(r"sha256:([0-9a-fA-F]{64})")
_NAMED = re.compile(r"([A-Za-z0-9_.-]{1,64})=([^=].*)")


@dataclass(frozen=True)
class ApiKey:
    id: str
    digest: bytes
    tenant: str = ""  # the tenant its jobs belong to ('' = its id)

    @property
    def tenant_name(self) -> str:
        return self.tenant or self.id

    def events_token(self, job_id: str) -> str:
        mac = hmac.new(self.digest, f"events:{job_id}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac[:18]).decode()


def _parse_entry(entry: str, setting: str) -> ApiKey:
    named = _NAMED.fullmatch(entry)
    tenant, entry = (named.group(1), named.group(2)) if named else ("", entry)
    hashed = _HASHED.fullmatch(entry)
    if hashed:
        digest = bytes.fromhex(hashed.group(1))
    elif entry.lower().startswith("sha256:"):
        raise ConfigError(f"invalid settings: {setting}: a sha256: entry needs 64 hex digits")
    else:
        digest = hashlib.sha256(entry.encode()).digest()
    return ApiKey(id="k" + digest.hex()[:16], digest=digest, tenant=tenant)


def parse_keys(
    value: SecretStr | None, setting: str = "CHATSTREAM_GATEWAY_API_KEYS"
) -> list[ApiKey]:
    """The keys of a comma-separated key setting (none when it is unset or empty)."""
    entries = [e.strip() for e in (value.get_secret_value() if value else "").split(",")]
    return [_parse_entry(entry, setting) for entry in entries if entry]


class ApiKeys:
    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = keys
        self._by_id = {key.id: key for key in keys}

    @classmethod
    def from_setting(cls, value: SecretStr | None) -> ApiKeys:
        """The keys of ``CHATSTREAM_GATEWAY_API_KEYS``; ConfigError when there are none."""
        keys = parse_keys(value)
        if not keys:
            raise ConfigError(
                "the gateway needs API keys: set CHATSTREAM_GATEWAY_API_KEYS "
                "(comma-separated keys, or sha256:<hex> of a key)"
            )
        return cls(keys)

    def check(self, presented: str) -> ApiKey | None:
        """The configured key equal to ``presented``, compared in constant time."""
        digest = hashlib.sha256(presented.encode()).digest()
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found

    def check_token(self, owner: str, job_id: str, token: str) -> ApiKey | None:
        """The owner's key when ``token`` is its events token for ``job_id``."""
        key = self._by_id.get(owner)
        if key is None or not hmac.compare_digest(
            key.events_token(job_id).encode(), token.encode()
        ):
            return None
        return key


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None when absent)."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return ""
    return token.strip()
