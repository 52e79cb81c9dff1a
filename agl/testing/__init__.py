"""Small twins of agl's seams for users' tests: :class:`InMemoryUpstream` stands in for a model server;
``free_port`` and ``wait_http`` start agl's servers as processes."""

from agl.testing.net import free_port, wait_http
from agl.testing.upstream import InMemoryUpstream, token_ids

__all__ = ["InMemoryUpstream", "free_port", "token_ids", "wait_http"]
