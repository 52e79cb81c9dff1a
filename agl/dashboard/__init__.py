"""The web dashboard: rollouts (search, sort, filters), traces with every span's attributes, what GRPO
trained on (groups, advantages, skip reasons, merged samples), resources versions with diffs, and curves.

``agl store serve`` serves it at ``/ui``; ``agl dashboard --store URL`` serves it for a remote store.
"""

from __future__ import annotations

from agl.dashboard.app import create_dashboard, mount_dashboard, standalone_app

__all__ = ["create_dashboard", "mount_dashboard", "standalone_app"]
