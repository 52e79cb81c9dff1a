"""Small twins of agl's seams for users' tests: :class:`InMemoryUpstream` stands in for a model server."""

from agl.testing.upstream import InMemoryUpstream, token_ids

__all__ = ["InMemoryUpstream", "token_ids"]
