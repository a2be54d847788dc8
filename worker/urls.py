"""URLs: the forms of ``CHATSTREAM_REDIS_URL`` taken apart, and URLs shown without secrets.

Pure (no I/O): settings validate ``CHATSTREAM_REDIS_URL`` with :func:`parse_redis_url`, and
``worker.store.redis_client`` builds clients from what it returns. The forms are described in
``worker.store.redis_client`` and docs/configuration.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from worker.errors import ConfigError

SENTINEL_QUERY = ("sentinel_username", "sentinel_password")
SECRET_QUERY_PARAMS = frozenset({"password", "ssl_password"})


def redacted_url(url: str) -> str:
    """The URL without its passwords (in the user info or the query string)."""
    scheme, sep, rest = url.partition("://")
    ends = [i for i in (rest.find("/"), rest.find("?")) if i >= 0]
    netloc, tail = rest[: min(ends, default=len(rest))], rest[min(ends, default=len(rest)) :]
    auth, at, host = netloc.rpartition("@")  # like urllib: the last "@" ends the user info
    if at:
        user = auth.split(":", 1)[0]
        netloc = f"{user}{':***' if ':' in auth else ''}@{host}"
    path, question, query = tail.partition("?")
    if question:
        params = [_redacted_param(param) for param in query.split("&")]
        tail = f"{path}?{'&'.join(params)}"
    return f"{scheme}{sep}{netloc}{tail}"


def _redacted_param(param: str) -> str:
    name, eq, _ = param.partition("=")
    return f"{name}=***" if eq and name.lower() in SECRET_QUERY_PARAMS else param


@dataclass(frozen=True, slots=True)
class RedisUrl:
    """``CHATSTREAM_REDIS_URL`` taken apart: its kind, nodes and redis-py options."""

    kind: str  # "single" | "cluster" | "sentinel"
    url: str  # a one-node URL redis-py parses (the first node; options and auth kept)
    nodes: tuple[tuple[str, int], ...] = ()  # cluster startup nodes or Sentinels
    service: str = ""  # Sentinel: the monitored master's name
    tls: bool = False
    sentinel_options: tuple[tuple[str, str], ...] = ()


def parse_redis_url(text: str) -> RedisUrl:
    """The URL's parts; ConfigError naming what is wrong with it."""
    scheme, sep, rest = text.partition("://")
    base, _, mode = scheme.partition("+")
    if (
        not sep
        or base not in ("redis", "rediss", "unix")
        or mode not in ("", "cluster", "sentinel")
    ):
        raise ConfigError(
            "CHATSTREAM_REDIS_URL must start with redis://, rediss://, unix://, "
            "redis+cluster://, rediss+cluster://, redis+sentinel:// or rediss+sentinel://"
        )
    if not mode:
        _check_database(text, base)
        return RedisUrl("single", text, tls=base == "rediss")
    if base == "unix":
        raise ConfigError(f"CHATSTREAM_REDIS_URL: {scheme}:// takes host:port pairs, not a socket")
    netloc, path, query = _split(rest)
    auth, at, hosts = netloc.rpartition("@")
    nodes = tuple(_host_port(item, scheme) for item in hosts.split(",") if item.strip())
    if not nodes:
        raise ConfigError(f"CHATSTREAM_REDIS_URL: {scheme}:// needs at least one host:port")
    options = parse_qsl(query, keep_blank_values=True)
    sentinel = tuple((k, v) for k, v in options if k in SENTINEL_QUERY)
    rest_query = urlencode([(k, v) for k, v in options if k not in SENTINEL_QUERY])
    service, db = _service_and_db(mode, path)
    host, port = nodes[0]
    one = f"{base}://{auth}{at}{_netloc(host, port)}/{db}" + (
        f"?{rest_query}" if rest_query else ""
    )
    return RedisUrl(mode, one, nodes, service, base == "rediss", sentinel)


def _check_database(text: str, base: str) -> None:
    """``redis://host:port/<db>``: the database is a number (redis-py would fail on the
    first command, or not at all, for ``/x``)."""
    parts = urlsplit(text)
    path = parts.path.strip("/") if base != "unix" else ""
    db = dict(parse_qsl(parts.query)).get("db", "")
    for value in (path, db):
        if value and not value.isdigit():
            raise ConfigError(
                f"CHATSTREAM_REDIS_URL: the database {value!r} is not a number "
                "(redis://host:port/0; 0 to 15 on a default server)"
            )


def _split(rest: str) -> tuple[str, str, str]:
    """``netloc``, ``path`` and ``query`` of what follows ``scheme://``."""
    head, _, query = rest.partition("?")
    netloc, slash, path = head.partition("/")
    return netloc, path if slash else "", query


def _host_port(item: str, scheme: str) -> tuple[str, int]:
    item = item.strip()
    host, colon, port = item.rpartition(":")
    if not colon or not port.isdigit() or not host:
        raise ConfigError(f"CHATSTREAM_REDIS_URL: {scheme}:// node {item!r} is not host:port")
    return host.strip("[]"), int(port)


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _service_and_db(mode: str, path: str) -> tuple[str, str]:
    parts = [unquote(part) for part in path.split("/") if part]
    if mode == "cluster":
        if parts not in ([], ["0"]):
            raise ConfigError("CHATSTREAM_REDIS_URL: a Redis Cluster has database 0 only")
        return "", "0"
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError(
            "CHATSTREAM_REDIS_URL: redis+sentinel://host:port[,host:port...]/<service>[/<db>]"
        )
    return parts[0], parts[1] if len(parts) == 2 else "0"
