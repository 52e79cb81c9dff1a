"""The LLM gateway: an OpenAI-compatible (and Anthropic Messages) proxy that records every model call as a span.

``Gateway(store, upstreams=["http://127.0.0.1:8000/v1"]).start()``; agents use
``gateway.rollout_base_url(rollout_id, attempt_id)`` as their OpenAI ``base_url``.
"""

from __future__ import annotations

from agl.gateway.app import Gateway
from agl.gateway.config import GatewayConfig, UpstreamConfig
from agl.gateway.recording import CallRecord, build_span

__all__ = ["CallRecord", "Gateway", "GatewayConfig", "UpstreamConfig", "build_span"]
