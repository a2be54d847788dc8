"""Finished spans as an OTLP/protobuf ``ExportTraceServiceRequest``, encoded directly.

The OTLP exporter builds one ``opentelemetry-proto`` message object per span, attribute
and value, then serializes them: 125-195 µs per worker span here, on the export thread
beside the event loop. This writes the same wire bytes straight from the SDK's spans, and
keeps the encoded ``KeyValue`` of attributes that repeat from span to span (operation,
provider, server, model, status): about 40 µs a span (decision 63,
``bench/bench_otel.py``). tests/unit/test_telemetry_spans.py checks, over generated spans,
that ``opentelemetry-proto`` parses these bytes into the message the SDK's encoder builds.

Only what the SDK's ``encode_spans`` writes is written, field for field; an attribute it
cannot encode (an integer beyond int64, an unknown type) is left out with a log line, as
there.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext

log = logging.getLogger("chatstream.telemetry")

CACHE_LIMIT = 4096  # encoded attributes kept; the cache starts over beyond it
_INT64_MIN, _INT64_MAX, _UINT64 = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
_FLAGS_HAS_IS_REMOTE, _FLAGS_IS_REMOTE = 0x100, 0x200  # SpanFlags
_double = struct.Struct("<d").pack
_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack
_CACHED_TYPES = (str, int, bool)  # floats are left out: 0.0 == -0.0 encode differently


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def _text(tag: bytes, text: str) -> bytes:
    return _field(tag, text.encode())


def any_value(value: Any) -> bytes:
    """An ``AnyValue`` message (raises TypeError or ValueError where the SDK's does)."""
    if value is None:
        return b""
    if isinstance(value, bool | str | int | float | bytes):
        return _scalar(value)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", any_value(v)) for v in value))
    if isinstance(value, Mapping):
        pairs = (_field(b"\x0a", key_value(str(k), v)) for k, v in value.items())
        return _field(b"\x32", b"".join(pairs))
    raise TypeError(f"invalid type {type(value).__name__} of value {value!r}")


def _scalar(value: bool | str | int | float | bytes) -> bytes:
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _text(b"\x0a", value)
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"integer out of the int64 range: {value}")
        return b"\x18" + _varint(value & _UINT64)
    if isinstance(value, float):
        return b"\x21" + _double(value)
    return _field(b"\x3a", value)


def key_value(key: str, value: Any) -> bytes:
    """A ``KeyValue`` message."""
    return _text(b"\x0a", key) + _field(b"\x12", any_value(value))


class SpanEncoder:
    """Encodes export requests; one per exporter (its cache is not shared across threads)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[bytes, str, type, Any], bytes] = {}  # with the field's tag

    def request(self, spans: Sequence[ReadableSpan]) -> bytes:
        """The serialized ``ExportTraceServiceRequest`` of ``spans``, grouped by resource,
        then instrumentation scope, in the order they first appear (as the SDK groups)."""
        groups: dict[Resource, dict[InstrumentationScope | None, list[bytes]]] = {}
        last: tuple[Resource | None, dict[InstrumentationScope | None, list[bytes]]]
        last = (None, {})
        for span in spans:
            resource = span.resource
            if resource is not last[0]:  # identity first: a Resource hashes through JSON
                last = (resource, groups.setdefault(resource, {}))
            scopes = last[1]
            scopes.setdefault(span.instrumentation_scope or None, []).append(self.span(span))
        return b"".join(
            _field(b"\x0a", self._resource_spans(resource, scopes))
            for resource, scopes in groups.items()
        )

    def span(self, span: ReadableSpan) -> bytes:
        """One ``Span`` message."""
        context = span.get_span_context()
        assert context is not None  # an SDK span always has one
        parts = [_ids(context)]
        if context.trace_state:
            state = ",".join(f"{key}={value}" for key, value in context.trace_state.items())
            parts.append(_text(b"\x1a", state))
        if span.parent is not None:
            parts.append(b"\x22\x08" + span.parent.span_id.to_bytes(8, "big"))
        if span.name:
            parts.append(_text(b"\x2a", span.name))
        parts.append(b"\x30" + _varint(span.kind.value + 1))
        if span.start_time:
            parts.append(b"\x39" + _fixed64(span.start_time))
        if span.end_time:
            parts.append(b"\x41" + _fixed64(span.end_time))
        parts += self.attributes(b"\x4a", span.attributes)
        parts += [_field(b"\x5a", self._event(event)) for event in span.events]
        parts += [_field(b"\x6a", self._link(link)) for link in span.links]
        parts += _counts((b"\x50", span.dropped_attributes), (b"\x60", span.dropped_events),
                         (b"\x70", span.dropped_links))  # fmt: skip
        parts.append(_field(b"\x7a", _status(span)))
        parts.append(b"\x85\x01" + _fixed32(_flags(span.parent)))
        return b"".join(parts)

    def attributes(self, tag: bytes, attributes: Mapping[str, Any] | None) -> list[bytes]:
        if not attributes:
            return []
        cache, encoded = self._cache, []
        for key, value in _plain(attributes).items():
            cacheable = type(value) in _CACHED_TYPES
            found = cache.get((tag, key, type(value), value)) if cacheable else None
            if found is None:
                try:
                    found = _field(tag, key_value(key, value))
                except (TypeError, ValueError) as exc:
                    log.error("OpenTelemetry: attribute %s left out of the span: %s", key, exc)
                    continue
                if cacheable:
                    if len(cache) >= CACHE_LIMIT:
                        cache.clear()
                    cache[tag, key, type(value), value] = found
            encoded.append(found)
        return encoded

    def _event(self, event: Event) -> bytes:
        parts = [b"\x09" + _fixed64(event.timestamp)] if event.timestamp else []
        if event.name:
            parts.append(_text(b"\x12", event.name))
        parts += self.attributes(b"\x1a", event.attributes)
        parts += _counts((b"\x20", event.dropped_attributes))
        return b"".join(parts)

    def _link(self, link: Link) -> bytes:
        parts = [_ids(link.context), *self.attributes(b"\x22", link.attributes)]
        parts += _counts((b"\x28", link.dropped_attributes))
        parts.append(b"\x35" + _fixed32(_flags(link.context)))
        return b"".join(parts)

    def _resource_spans(
        self, resource: Resource, scopes: Mapping[InstrumentationScope | None, list[bytes]]
    ) -> bytes:
        parts = [_field(b"\x0a", b"".join(self.attributes(b"\x0a", resource.attributes)))]
        for scope, spans in scopes.items():
            scope_spans = [_field(b"\x0a", self._scope(scope))]
            scope_spans += [_field(b"\x12", span) for span in spans]
            if scope is not None and scope.schema_url:
                scope_spans.append(_text(b"\x1a", scope.schema_url))
            parts.append(_field(b"\x12", b"".join(scope_spans)))
        if resource.schema_url:
            parts.append(_text(b"\x1a", resource.schema_url))
        return b"".join(parts)

    def _scope(self, scope: InstrumentationScope | None) -> bytes:
        if scope is None:
            return b""
        parts = [_text(b"\x0a", scope.name)] if scope.name else []
        if scope.version:
            parts.append(_text(b"\x12", scope.version))
        parts += self.attributes(b"\x1a", scope.attributes)
        return b"".join(parts)


def _plain(attributes: Mapping[str, Any]) -> Mapping[str, Any]:
    """A dict of the attributes: a span's are a proxy of BoundedAttributes, whose item
    view is a Python generator (1 µs an item); its ``copy`` is a dict's."""
    copy = getattr(attributes, "copy", None)
    return copy() if callable(copy) else attributes


def _ids(context: SpanContext) -> bytes:
    """``trace_id`` (field 1) and ``span_id`` (field 2), as Span and Link both have them."""
    trace_id, span_id = context.trace_id.to_bytes(16, "big"), context.span_id.to_bytes(8, "big")
    return b"\x0a\x10" + trace_id + b"\x12\x08" + span_id


def _counts(*counts: tuple[bytes, int]) -> list[bytes]:
    return [tag + _varint(count) for tag, count in counts if count]


def _status(span: ReadableSpan) -> bytes:
    status, parts = span.status, []
    if status.description:
        parts.append(_text(b"\x12", status.description))
    if status.status_code.value:
        parts.append(b"\x18" + _varint(status.status_code.value))
    return b"".join(parts)


def _flags(parent: SpanContext | None) -> int:
    if parent is not None and parent.is_remote:
        return _FLAGS_HAS_IS_REMOTE | _FLAGS_IS_REMOTE
    return _FLAGS_HAS_IS_REMOTE
