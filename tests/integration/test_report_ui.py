"""The report as a person sees it in the Prefect UI: a real ``prefect server``, the markdown artifact
the evaluate stage publishes (:func:`pivotrl.evaluation.report.published_markdown`), opened in
headless Chromium (driven over the DevTools protocol): every plot loads as an image, no table is
wider than its box (the UI hides the scroll bar, so a wider table is cut off).

Needs a Chromium binary (Debian: ``apt-get install -y chromium``); skipped, saying so, without one.
``PIVOTRL_UI_SCREENSHOT=<file.png>`` keeps a screenshot of the artifact page.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from browser import CHROMIUM, NO_CHROMIUM, chromium_page
from servers import free_port, server

pytestmark = pytest.mark.integration

PREFECT = str(Path(sys.executable).with_name("prefect"))


def _json(url: str, body: object | None = None) -> object:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


def _report(tmp_path: Path) -> tuple[Path, str]:
    """A report built from small real inputs and stored as the pipeline stores it; its published text."""
    from pivotrl.evaluation.comparison import compare_policies
    from pivotrl.evaluation.report import build_report, published_markdown
    from pivotrl.storage.store import ArtifactStore

    def local(k, n):
        return {"accuracy": k / n, "n_accepted": k, "n_samples": n, "n_states": n}

    def full(k, n):
        return {"success_rate": k / n, "n_success": k, "n_tasks": n, "turn_pass_rate": (k + 3) / (2 * n),
                "turns_passed": k + 3, "turns_total": 2 * n, "format_error_rate": 0.1, "format_errors": 2,
                "model_calls": 20}

    results = {"base": {"local": local(1, 40), "full_task": full(0, 10)},
               "reference": {"local": local(12, 40), "full_task": full(1, 10)},
               "pivotrl": {"local": local(19, 40), "full_task": full(2, 10), "local_pivots": local(5, 8)}}
    metrics = pd.DataFrame({"step": range(1, 9), "reward_mean": [0.1875, 0.15625, 0.0, 0.1875, 0.1875, 0.09375,
                                                                 0.09375, 0.40625]})
    probes = pd.DataFrame({"mu": [0.0, 0.125, 0.25, 0.25, 0.5, 0.625, 1.0, 1.0]})
    counts = {"candidates": 8, "all_fail": 1, "all_pass": 2, "above_threshold": 2, "kept": 3, "skipped_too_long": 0,
              "skipped_verifier_error": 0}
    stats = {"lambda_diff": 0.5, "total": counts, "per_category": {"multi_turn_base": counts},
             "per_turn_index": {0: counts}, "mu_histogram": {"bin_centers": [0.0, 0.5, 1.0], "counts": [1, 5, 2]},
             "mu_mean": 0.43, "verifier_retries": 0}
    per_task = pd.DataFrame([{"policy": p, "seed": 0, "task_id": f"t{i}", "success": i < k, "turns_passed": i % 2,
                              "n_turns": 2} for p, k in (("pivotrl", 2), ("reference", 1), ("base", 0))
                             for i in range(10)])
    local_df = pd.DataFrame([{"policy": p, "seed": 0, "kind": "heldout_greedy", "state_id": f"s{i}", "status": "ok",
                              "n_samples": 1, "n_accepted": int(i < k)} for p, k in (("pivotrl", 19), ("reference", 12),
                                                                                      ("base", 1)) for i in range(40)])
    comparison = compare_policies(per_task, local_df, ["pivotrl", "reference", "base"])
    build_report(results, metrics_df=metrics, probe_df=probes, pivot_stats=stats, statistics=comparison,
                 meta={"run": "ui-check", "model_source": "tiny", "config_hash": "5b22" * 16,
                       "full_task_metric_differs_from_bfcl": [
                           "step limit: 2 per turn, BFCL's is 20", "subset: 1 held-out task of the 200",
                           "prompt: pivotrl's renderer and action format, not BFCL's system prompt and handler"]},
                 out_dir=tmp_path / "rep")
    store = ArtifactStore(str(tmp_path / "store"))
    for f in (tmp_path / "rep").iterdir():
        store.write_bytes(f"eval/ui/{f.name}", f.read_bytes())
    return tmp_path / "rep", published_markdown(store, "eval/ui")


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_report_artifact_shows_every_plot_and_fits_in_the_prefect_ui(tmp_path):
    rep, markdown = _report(tmp_path)
    plots = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", (rep / "report.md").read_text())  # what report.md links
    sizes = {name: struct.unpack(">II", (rep / name).read_bytes()[16:24]) for name in plots}  # the PNG header's w, h
    home = tmp_path / "prefect-home"
    home.mkdir()
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "1"}
    cmd = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with server(cmd, home / "server.log", ready=f"{api}/health", what="prefect server", timeout_s=120, env=env):
        art = _json(f"{api}/artifacts/", {"key": "report", "type": "markdown", "data": markdown,
                                          "description": "PivotRL report"})
        with chromium_page(tmp_path) as page:
            page.goto(f"http://127.0.0.1:{port}/artifacts/artifact/{art['id']}")
            probe = ("(() => { const imgs = [...document.querySelectorAll('img.markdown-renderer__image')];"
                     " return {imgs: imgs.map(i => ({src: i.src.slice(0, 22), complete: i.complete,"
                     " w: i.naturalWidth, h: i.naturalHeight, shown: i.getBoundingClientRect().width})),"
                     " tables: [...document.querySelectorAll('.markdown-renderer__table')].map(t =>"
                     " ({scroll: t.scrollWidth, client: t.clientWidth})),"
                     " text: document.body.innerText.includes('Results per policy')}; })()")
            page.wait_for(f"(() => {{ const s = {probe}; return s.text && s.imgs.length === {len(plots)} && "
                          "s.imgs.every(i => i.complete); }})()", timeout_s=120)
            seen = page.eval(probe) or {}
            shot = os.environ.get("PIVOTRL_UI_SCREENSHOT")
            if shot:
                page.screenshot(shot)
    assert seen.get("text"), f"the artifact page did not render the report: {seen}"
    imgs = seen["imgs"]
    assert len(imgs) == len(plots) >= 3, imgs
    for img, name in zip(imgs, plots):  # decoded by the browser at the size the PNG has, and laid out
        assert img["src"] == "data:image/png;base64," and img["complete"], img
        assert (img["w"], img["h"]) == sizes[name] and img["shown"] > 300, (img, name)
    assert len(seen["tables"]) >= 8  # 3 results, 2 comparisons, 3 pivot statistics (the run is a list)
    too_wide = [t for t in seen["tables"] if t["scroll"] > t["client"] + 1]
    assert not too_wide, f"tables cut off (content width > box width): {too_wide}"
