"""OTLP/HTTP trace ingest: ExportTraceServiceRequest bodies (protobuf or JSON) to agl spans.

Each span must say which rollout and attempt it belongs to, in a span or resource attribute:
``agl.rollout_id`` and ``agl.attempt_id``. A span without them rejects the whole request (400).
"""

from __future__ import annotations

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


def _any_value(value: dict[str, Any]) -> Any:
    """An OTLP JSON AnyValue as plain JSON."""
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in value:
            return value[key]
    if "intValue" in value:
        return int(value["intValue"])
    if "arrayValue" in value:
        return [_any_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return _attributes(value["kvlistValue"].get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def _attributes(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: _any_value(kv.get("value", {})) for kv in items}


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


def _kind(value: Any) -> str:
    return (
        _KIND_NAMES.get(value, "internal")
        if isinstance(value, str)
        else _KINDS.get(int(value or 0), "internal")
    )


def _status(value: Any) -> str:
    return (
        _STATUS_NAMES.get(value, "unset") if isinstance(value, str) else _STATUS.get(int(value or 0), "unset")
    )


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
    for rs in request.get("resourceSpans", []):
        resource = _attributes(rs.get("resource", {}).get("attributes", []))
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                attrs = _attributes(span.get("attributes", []))
                rollout_id = attrs.get(sc.ROLLOUT_ID) or resource.get(sc.ROLLOUT_ID)
                attempt_id = attrs.get(sc.ATTEMPT_ID) or resource.get(sc.ATTEMPT_ID)
                missing = [k for k, v in ((sc.ROLLOUT_ID, rollout_id), (sc.ATTEMPT_ID, attempt_id)) if not v]
                if missing:
                    raise InvalidSpanError(
                        f"span {span.get('name')!r} has no {' or '.join(missing)}: set it as a span or resource "
                        "attribute so the store knows which rollout attempt the span belongs to"
                    )
                status = span.get("status", {})
                raw.append(
                    {
                        "rollout_id": rollout_id,
                        "attempt_id": attempt_id,
                        "trace_id": str(span.get("traceId", "")).lower(),
                        "span_id": str(span.get("spanId", "")).lower(),
                        "parent_id": str(span.get("parentSpanId") or "").lower() or None,
                        "name": span.get("name", ""),
                        "kind": _kind(span.get("kind")),
                        "start_time_ns": int(span.get("startTimeUnixNano", 0)),
                        "end_time_ns": int(span.get("endTimeUnixNano", 0)),
                        "attributes": attrs,
                        "events": [
                            {
                                "name": e.get("name", ""),
                                "time_ns": int(e.get("timeUnixNano", 0)),
                                "attributes": _attributes(e.get("attributes", [])),
                            }
                            for e in span.get("events", [])
                        ],
                        "links": [
                            {
                                "trace_id": str(link.get("traceId", "")).lower(),
                                "span_id": str(link.get("spanId", "")).lower(),
                                "attributes": _attributes(link.get("attributes", [])),
                            }
                            for link in span.get("links", [])
                        ],
                        "status": {"code": _status(status.get("code")), "description": status.get("message")},
                        "resource": resource,
                    }
                )
    return coerce_spans(raw)
