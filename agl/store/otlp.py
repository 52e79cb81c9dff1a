"""OTLP/HTTP trace ingest: ExportTraceServiceRequest bodies (protobuf or JSON) to agl spans.

Each span must say which rollout and attempt it belongs to, in a span or resource attribute:
``agl.rollout_id`` and ``agl.attempt_id``. A span without them rejects the whole request (400).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import orjson

from agl import semconv as sc
from agl.errors import InvalidSpanError, StoreError
from agl.schemas import Span
from agl.store._logic import coerce_spans

_KINDS = {0: "internal", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_STATUS = {0: "unset", 1: "ok", 2: "error"}
_KIND_NAMES = {f"SPAN_KIND_{k.upper()}": k for k in ("internal", "server", "client", "producer", "consumer")}
_STATUS_NAMES = {"STATUS_CODE_UNSET": "unset", "STATUS_CODE_OK": "ok", "STATUS_CODE_ERROR": "error"}


class OtlpShapeError(InvalidSpanError):
    """The request is not an ExportTraceServiceRequest: ``param`` names where, as an OTLP JSON path."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path} {problem}")
        self.param = path


def _obj(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise OtlpShapeError(path, f"must be an object, got {_kind_of(value)}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise OtlpShapeError(path, f"must be an array, got {_kind_of(value)}")
    return value


def _int(value: Any, path: str, signed: bool = False) -> int:
    """OTLP JSON writes 64-bit integers as decimal strings; numbers are accepted too."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise OtlpShapeError(path, f"must be an integer or a decimal string, got {_kind_of(value)}")
    try:
        number = int(value)
    except ValueError:
        raise OtlpShapeError(
            path, f"must be an integer or a decimal string, got {str(value)[:40]!r}"
        ) from None
    low = -(2**63) if signed else 0
    if not low <= number < 2**64:
        raise OtlpShapeError(path, f"must fit in a 64-bit integer, got {number}")
    return number


def _double(value: Any, path: str) -> float:
    """A finite double; proto3 JSON may write one as a string ("1.5", "NaN", "Infinity")."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise OtlpShapeError(path, f"must be a number, got {_kind_of(value)}")
    try:
        number = float(value)
    except ValueError:
        raise OtlpShapeError(path, f"must be a number, got {str(value)[:40]!r}") from None
    if not math.isfinite(number):
        raise OtlpShapeError(
            path, f"is {value}; agl stores JSON, which has no NaN or Infinity: send a finite number"
        )
    return number


def decode_content(body: bytes, encoding: str, max_bytes: int) -> bytes:
    """The body with its ``Content-Encoding`` (gzip or deflate) undone, decompressed to at most ``max_bytes``.

    Raises:
        BodyTooLargeError: the decompressed body exceeds ``max_bytes`` (a zip bomb stops there).
        StoreError: the encoding is unknown or the compressed data is corrupt.
    """
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise StoreError(f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or no encoding")
    out: list[bytes] = []
    size, data = 0, body
    try:
        while True:  # a gzip stream may hold several members one after another
            inflater = zlib.decompressobj(wbits)
            chunk = inflater.decompress(data, max_bytes - size + 1)
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLargeError(
                    f"the decompressed body exceeds {max_bytes} bytes; send smaller batches"
                )
            if not inflater.eof:
                raise StoreError(f"the {encoding} body is truncated; send the whole compressed body")
            out.append(chunk)
            data = inflater.unused_data
            if not data:
                return b"".join(out)
    except zlib.error as exc:
        raise StoreError(
            f"the body is not valid {encoding} ({exc}); fix it or drop Content-Encoding"
        ) from exc


_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class BodyTooLargeError(StoreError):
    """A request body beyond the server's limit (after decompression)."""


def _str(value: Any, path: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise OtlpShapeError(path, f"must be a string, got {_kind_of(value)}")
    return value


def _kind_of(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _any_value(value: Any, path: str) -> Any:
    """An OTLP JSON AnyValue as plain JSON."""
    value = _obj(value, path)
    for key in ("stringValue", "boolValue", "bytesValue"):
        if key in value:
            return value[key]
    if "doubleValue" in value:
        return _double(value["doubleValue"], f"{path}.doubleValue")
    if "intValue" in value:
        return _int(value["intValue"], f"{path}.intValue", signed=True)
    if "arrayValue" in value:
        items = _list(
            _obj(value["arrayValue"], f"{path}.arrayValue").get("values"), f"{path}.arrayValue.values"
        )
        return [_any_value(v, f"{path}.arrayValue.values[{i}]") for i, v in enumerate(items)]
    if "kvlistValue" in value:
        kvlist = _obj(value["kvlistValue"], f"{path}.kvlistValue")
        return _attributes(kvlist.get("values"), f"{path}.kvlistValue.values")
    return None


def _attributes(items: Any, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, kv in enumerate(_list(items, path)):
        kv = _obj(kv, f"{path}[{i}]")
        out[_str(kv.get("key"), f"{path}[{i}].key")] = _any_value(kv.get("value"), f"{path}[{i}].value")
    return out


def _from_protobuf(body: bytes) -> dict[str, Any]:
    """Protobuf to the OTLP JSON shape (hex ids), so one converter serves both encodings."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except Exception as exc:
        raise StoreError(f"body is not an OTLP ExportTraceServiceRequest protobuf: {exc}") from exc
    as_dict: dict[str, Any] = MessageToDict(request)
    # MessageToDict writes bytes as base64 but OTLP JSON uses hex ids: copy them over from the message
    for rs, resource_spans in zip(as_dict.get("resourceSpans", []), request.resource_spans, strict=False):
        for ss, scope_spans in zip(rs.get("scopeSpans", []), resource_spans.scope_spans, strict=False):
            for sd, span in zip(ss.get("spans", []), scope_spans.spans, strict=False):
                sd["traceId"], sd["spanId"] = span.trace_id.hex(), span.span_id.hex()
                sd["parentSpanId"] = span.parent_span_id.hex()
                for ld, link in zip(sd.get("links", []), span.links, strict=False):
                    ld["traceId"], ld["spanId"] = link.trace_id.hex(), link.span_id.hex()
    return as_dict


def _kind(value: Any, path: str) -> str:
    if isinstance(value, str):
        return _KIND_NAMES.get(value, "internal")
    return _KINDS.get(_int(value, path), "internal")


def _status(value: Any, path: str) -> str:
    if isinstance(value, str):
        return _STATUS_NAMES.get(value, "unset")
    return _STATUS.get(_int(value, path), "unset")


def parse_otlp(body: bytes, content_type: str) -> list[Span]:
    """Validated spans of an OTLP export request.

    Raises:
        StoreError: the body cannot be decoded.
        InvalidSpanError: a span misses ``agl.rollout_id`` / ``agl.attempt_id`` or is malformed.
    """
    if "json" in content_type:
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise StoreError(f"body is not JSON: {exc}") from exc
    else:
        request = _from_protobuf(body)
    raw: list[dict[str, Any]] = []
    request = _obj(request, "<body>")
    for r, rs in enumerate(_list(request.get("resourceSpans"), "resourceSpans")):
        at = f"resourceSpans[{r}]"
        rs = _obj(rs, at)
        resource = _attributes(
            _obj(rs.get("resource"), f"{at}.resource").get("attributes"), f"{at}.resource.attributes"
        )
        for q, ss in enumerate(_list(rs.get("scopeSpans"), f"{at}.scopeSpans")):
            for n, span in enumerate(
                _list(_obj(ss, f"{at}.scopeSpans[{q}]").get("spans"), f"{at}.scopeSpans[{q}].spans")
            ):
                raw.append(
                    _span(
                        _obj(span, f"{at}.scopeSpans[{q}].spans[{n}]"),
                        resource,
                        f"{at}.scopeSpans[{q}].spans[{n}]",
                    )
                )
    return coerce_spans(raw)


def _span(span: dict[str, Any], resource: dict[str, Any], at: str) -> dict[str, Any]:
    """One OTLP JSON span as an agl span dict (validated afterwards by ``coerce_spans``)."""
    attrs = _attributes(span.get("attributes"), f"{at}.attributes")
    rollout_id = attrs.get(sc.ROLLOUT_ID) or resource.get(sc.ROLLOUT_ID)
    attempt_id = attrs.get(sc.ATTEMPT_ID) or resource.get(sc.ATTEMPT_ID)
    missing = [k for k, v in ((sc.ROLLOUT_ID, rollout_id), (sc.ATTEMPT_ID, attempt_id)) if not v]
    if missing:
        raise InvalidSpanError(
            f"span {span.get('name')!r} has no {' or '.join(missing)}: set it as a span or resource "
            "attribute so the store knows which rollout attempt the span belongs to"
        )
    status = _obj(span.get("status"), f"{at}.status")
    events = []
    for i, e in enumerate(_list(span.get("events"), f"{at}.events")):
        e = _obj(e, f"{at}.events[{i}]")
        events.append(
            {
                "name": _str(e.get("name"), f"{at}.events[{i}].name"),
                "time_ns": _int(e.get("timeUnixNano"), f"{at}.events[{i}].timeUnixNano"),
                "attributes": _attributes(e.get("attributes"), f"{at}.events[{i}].attributes"),
            }
        )
    links = []
    for i, link in enumerate(_list(span.get("links"), f"{at}.links")):
        link = _obj(link, f"{at}.links[{i}]")
        links.append(
            {
                "trace_id": _str(link.get("traceId"), f"{at}.links[{i}].traceId").lower(),
                "span_id": _str(link.get("spanId"), f"{at}.links[{i}].spanId").lower(),
                "attributes": _attributes(link.get("attributes"), f"{at}.links[{i}].attributes"),
            }
        )
    return {
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "trace_id": _str(span.get("traceId"), f"{at}.traceId").lower(),
        "span_id": _str(span.get("spanId"), f"{at}.spanId").lower(),
        "parent_id": _str(span.get("parentSpanId"), f"{at}.parentSpanId").lower() or None,
        "name": _str(span.get("name"), f"{at}.name"),
        "kind": _kind(span.get("kind"), f"{at}.kind"),
        "start_time_ns": _int(span.get("startTimeUnixNano"), f"{at}.startTimeUnixNano"),
        "end_time_ns": _int(span.get("endTimeUnixNano"), f"{at}.endTimeUnixNano"),
        "attributes": attrs,
        "events": events,
        "links": links,
        "status": {
            "code": _status(status.get("code"), f"{at}.status.code"),
            "description": _str(status.get("message"), f"{at}.status.message") or None,
        },
        "resource": resource,
    }
