"""Screenshots of the dashboard on a store, for checking a real run by eye (headless Chromium via Playwright).

Starts `agl store serve` on the store and `agl dashboard` in front of it, opens each page a person looks at
first, and writes a PNG of each to --out: the rollout list, the list filtered on calls and sorted by reward,
the rollout with the most calls, the curves, and what changed between the first and the last version (and
between the last two). For a
`fit` run, --metrics-dir (its output folder) adds its metric curves, the groups of --step and one of them,
and the task that changed most across versions.

    python scripts/dashboard_shots.py --store sqlite:///results/calc/store.db --out results/dashboard-shots
    python scripts/dashboard_shots.py --store sqlite:///results/sql_agent/store.db \
        --metrics-dir results/sql_agent --step 2 --out results/dashboard-shots
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from agl.testing import free_port, wait_http

TOKEN = "shots-token"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def shoot(base: str, out: Path, calls_min: int, step: int | None) -> list[Path]:
    """Open each page and write its screenshot; returns the files."""
    from playwright.sync_api import sync_playwright

    def get(path: str, **params: str | int) -> dict[str, Any]:
        api = {"authorization": f"Bearer {TOKEN}"}
        found: dict[str, Any] = httpx.get(
            f"{base}/ui/api/{path}", params=params, headers=api, timeout=60
        ).json()
        return found

    listed = get("rollouts", limit=1, sort="calls")
    busiest = listed["items"][0]["rollout_id"] if listed.get("items") else None
    pages = {
        "list": "#/rollouts",
        "list-calls": f"#/rollouts?calls_min={calls_min}&sort=reward&order=desc",
        "curves": "#/curves",
        "changes": "#/changes",
    }
    if busiest:
        pages["rollout"] = f"#/rollout/{busiest}"
    if step is not None:  # a fit run's step: its groups, and the first group whose rewards differ
        pages["step"] = f"#/step/{step}"
        groups = [g for g in get("groups", step=step).get("items", []) if not g.get("zero_variance")]
        if groups:
            pages["group"] = f"#/group/{groups[0]['group_id']}"
    compared = get("changes")
    if compared.get("changed"):  # the held-out task whose reward moved most, at every version
        pages["task"] = f"#/task/{compared['changed'][0]['after']['rollout_id']}?mode=val"
    if len(compared.get("steps") or []) > 1:  # the last version against the one before it
        last = compared["steps"][-1]
        pages["changes-last"] = f"#/changes?before={last['before']}&after={last['after']}"
    written = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{base}/ui/?token={TOKEN}")
        for name, route in pages.items():
            page.goto(f"{base}/ui/{route}")
            page.wait_for_load_state("networkidle")
            time.sleep(1.0)  # charts draw after their data arrives
            path = out / f"{name}.png"
            page.screenshot(path=str(path), full_page=False)
            written.append(path)
        browser.close()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--store", required=True, help="a store URL: sqlite:///path.db or postgresql://...")
    parser.add_argument("--out", type=Path, default=Path("results/dashboard-shots"))
    parser.add_argument("--calls-min", type=int, default=3, help="the filtered list's lower bound on calls")
    parser.add_argument(
        "--metrics-dir", type=Path, default=None, help="a fit run's output folder (metrics.csv)"
    )
    parser.add_argument("--step", type=int, default=None, help="a training step whose groups to show")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    store_port, ui_port = free_port(), free_port()
    env = dict(os.environ)
    agl = [sys.executable, "-m", "agl"]
    procs = [
        subprocess.Popen(
            [*agl, "store", "serve", "--backend", args.store, "--port", str(store_port)], env=env
        ),
    ]
    try:
        wait_http(f"http://127.0.0.1:{store_port}/health")
        procs.append(
            subprocess.Popen(
                [*agl, "dashboard", "--store", f"http://127.0.0.1:{store_port}", "--port", str(ui_port),
                 "--token", TOKEN, *(["--metrics-dir", str(args.metrics_dir)] if args.metrics_dir else [])],
                env=env,
            )
        )  # fmt: skip
        base = f"http://127.0.0.1:{ui_port}"
        wait_http(f"{base}/ui/")
        for path in shoot(base, args.out, args.calls_min, args.step):
            print(path)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
