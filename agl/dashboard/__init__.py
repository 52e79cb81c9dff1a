"""The web dashboard: rollouts, traces, rewards, resources versions (with APO prompt diffs) and training curves.

``agl store serve`` serves it at ``/ui``; ``agl dashboard --store URL`` serves it for a remote store.
"""

from __future__ import annotations

from agl.dashboard.app import create_dashboard, mount_dashboard, standalone_app

__all__ = ["create_dashboard", "mount_dashboard", "standalone_app"]
