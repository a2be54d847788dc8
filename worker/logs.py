"""Logging: human-readable lines by default, JSON lines with ``CHATSTREAM_LOG_FORMAT=json``.

Every line logged while a job is handled carries the job id and attempt (and the worker
name): the runner binds them to context variables in the job's own asyncio task, and
:class:`ContextFilter` copies them onto each record. :class:`RedactFilter` masks the
secrets the settings know (API keys, the Redis password) should one ever reach a message
or a traceback. Both filters sit on the handler, so they cover third-party loggers too.

JSON lines have ``ts``, ``level``, ``logger``, ``message``, then ``worker``, ``job``,
``attempt`` when known, ``trace_id`` and ``span_id`` while an OpenTelemetry span is active
(a traced job's lines: its attempt's span), the line's own structured ``fields``
(``extra={"fields": {...}}``: the start-up configuration, a failed job's error) and
``exc`` (the formatted traceback) when there is one.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import IO, Any
from urllib.parse import parse_qsl, unquote, urlsplit

from worker.settings import Settings
from worker.telemetry import log_ids

MASK = "***"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONTEXT_FIELDS = ("worker", "job", "attempt")

_worker: ContextVar[str | None] = ContextVar("chatstream_worker", default=None)
_job: ContextVar[str | None] = ContextVar("chatstream_job", default=None)
_attempt: ContextVar[int | None] = ContextVar("chatstream_attempt", default=None)


def bind(*, worker: str | None = None, job: str | None = None) -> None:
    """Tag the current context (an asyncio task: a job's, or a background one)."""
    if worker is not None:
        _worker.set(worker)
    if job is not None:
        _job.set(job)
        _attempt.set(None)


def set_attempt(attempt: int) -> None:
    _attempt.set(attempt)


@contextmanager
def job_context(job: str | None, attempt: int | None = None) -> Iterator[None]:
    """Tag the lines logged inside the block with a job (and attempt) that is not the
    current task's: a background task logging about a job (a cancel, a lost lease)."""
    job_token, attempt_token = _job.set(job), _attempt.set(attempt)
    try:
        yield
    finally:
        _job.reset(job_token)
        _attempt.reset(attempt_token)


def context() -> dict[str, str | int]:
    """The bound worker / job / attempt, only those that are known."""
    values = {"worker": _worker.get(), "job": _job.get(), "attempt": _attempt.get()}
    return {name: value for name, value in values.items() if value is not None}


class ContextFilter(logging.Filter):
    """Copies the bound worker / job / attempt onto every record (None when unknown)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = _worker.get()
        record.job = _job.get()
        record.attempt = _attempt.get()
        return True


class RedactFilter(logging.Filter):
    """Replaces every configured secret in the message and traceback text with ``***``.

    Only whole credentials are masked: a secret whose first (last) character is a letter,
    digit or ``_`` matches only where the text's character before (after) it is not one, so
    a short key (``x``) masks ``Bearer x`` but leaves ``prefix=cs`` alone, where plain
    substring replacement wrote ``prefi***=cs``. (A one-letter key still masks that letter
    where it stands alone, a host name ``x.example`` say: keys that short are for tests.)
    """

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = secrets

    @property
    def secrets(self) -> list[str]:
        return self._secrets

    @secrets.setter
    def secrets(self, values: list[str]) -> None:
        # longest first, so a secret containing another one is masked whole
        self._secrets = sorted({s for s in values if s}, key=len, reverse=True)
        self._pattern = _whole_credentials(self._secrets)

    def redact(self, text: str, mask: str = MASK) -> str:
        return text if self._pattern is None else self._pattern.sub(lambda _: mask, text)

    def redact_value(self, value: Any) -> Any:
        """``value`` with every string in it (nested in dicts and lists too) redacted."""
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, dict):
            return {key: self.redact_value(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.redact_value(item) for item in value]
        return value

    def filter(self, record: logging.LogRecord) -> bool:
        if self._pattern is None:
            return True
        try:
            message = record.getMessage()
        except Exception:  # bad arguments: the handler reports that when it formats
            return True
        redacted = self.redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            record.fields = self.redact_value(fields)
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        return True


def mask_credentials(text: str, secrets: list[str], mask: str = MASK) -> str:
    """``text`` with each secret replaced by ``mask`` where it stands whole, as the logs
    mask them (:class:`RedactFilter`); what the worker stores of an upstream's error body
    goes through it too, so a short key masks no part of another word there either."""
    return RedactFilter(secrets).redact(text, mask)


_WORD = frozenset("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")


def _whole_credentials(secrets: list[str]) -> re.Pattern[str] | None:
    """One pattern for every secret, each only where it is not part of a longer word."""
    if not secrets:
        return None
    alternatives = [
        ("(?<![0-9A-Za-z_])" if secret[0] in _WORD else "")
        + re.escape(secret)
        + ("(?![0-9A-Za-z_])" if secret[-1] in _WORD else "")
        for secret in secrets
    ]
    return re.compile("|".join(alternatives))


def secrets_of(settings: Settings) -> list[str]:
    """Every secret value the settings hold: API keys (upstreams', the gateway's), upstream
    headers, the Redis password."""
    found: list[str] = []
    if settings.upstream_api_key is not None:
        found.append(settings.upstream_api_key.get_secret_value())
    for upstream in settings.upstreams.values():
        if upstream.api_key is not None:
            found.append(upstream.api_key.get_secret_value())
        found.extend(
            value.partition(" ")[2] or value
            for name, value in upstream.headers.items()
            if name.lower() in {"authorization", "x-api-key", "api-key"}
        )
    for keys in (settings.gateway_api_keys, settings.dashboard_keys):
        if keys is not None:
            found.extend(_key_values(keys.get_secret_value()))
    url = urlsplit(settings.redis_url)
    passwords = [url.password or ""]
    passwords += [v for k, v in parse_qsl(url.query) if k.lower() in {"password", "ssl_password"}]
    for password in filter(None, passwords):
        found += [password, unquote(password)]
    return found


def _key_values(setting: str) -> list[str]:
    """The keys of a comma-separated key list: each entry, and its key after a ``name=``."""
    found = []
    for entry in (e.strip() for e in setting.split(",")):
        found.append(entry)
        name, sep, key = entry.partition("=")
        if sep and key and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            found.append(key)
    return found


class TextFormatter(logging.Formatter):
    """``2024-01-01 12:00:00,000 INFO chatstream.worker: message [job=… attempt=2]``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        tags = " ".join(
            f"{name}={value}"
            for name in ("job", "attempt")
            if (value := getattr(record, name, None)) is not None
        )
        return f"{line} [{tags}]" if tags else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        line.update(log_ids())  # trace_id, span_id while a span is active (OpenTelemetry)
        fields = getattr(record, "fields", None)  # logger.warning(..., extra={"fields": {}})
        if isinstance(fields, dict):
            line.update((k, v) for k, v in fields.items() if k not in line)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def build_handler(settings: Settings, stream: IO[str] | None = None) -> logging.Handler:
    """A stream handler with the configured format, the context and the redaction filters."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    handler.addFilter(RedactFilter(secrets_of(settings)))
    return handler


def configure(settings: Settings, stream: IO[str] | None = None) -> logging.Handler:
    """Install the chatstream handler on the root logger (replacing an earlier one)."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "chatstream", False)]:
        root.removeHandler(old)
    handler = build_handler(settings, stream)
    handler.chatstream = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(settings.log_level)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return handler
