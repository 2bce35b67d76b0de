"""A newcomer's first SAEBench comparison, in the browser: `manage.py serve` on a fresh embedded data
directory (the demo model, its text and its labelled topics, built as `make run` builds them),
signed in as the demo user, a group of 8 SAEs trained from the model's form (two hooks x four k),
judged from the group's "Compare with SAEBench's metrics" link with the core metrics and sparse
probing on the demo's topics, sorted, one result downloaded; the comparison page's screenshot goes
to docs/screenshots/saebench-compare-demo-{light,dark}.png. Prints the times of each step.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/saebench_newcomer.py [--tokens 400000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "docs" / "screenshots"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    from playwright.sync_api import expect, sync_playwright

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=400_000, help="each SAE's training tokens")
    parser.add_argument("--keep", default="", help="a data directory to use (and keep)")
    args = parser.parse_args()
    data = Path(args.keep or tempfile.mkdtemp(prefix="mistudio-newcomer-"))
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    environment = {
        key: value for key, value in os.environ.items() if key not in ("DATABASE_URL", "REDIS_URL")
    }
    environment.update(MISTUDIO_DATA_DIR=str(data), HF_HUB_OFFLINE="1")
    started = time.monotonic()
    log = open(data / "serve.log", "w")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port)], cwd=ROOT, env=environment,
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    steps: list[tuple[str, float]] = []

    def step(name: str) -> None:
        steps.append((name, time.monotonic() - started))
        print(f"{time.monotonic() - started:7.1f} s  {name}", flush=True)

    try:
        while True:
            try:
                urllib.request.urlopen(f"{base}/healthz", timeout=2)  # noqa: S310
                break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit((data / "serve.log").read_text()[-3000:]) from None
                time.sleep(2)
        step("serving (demo model trained and registered)")
        credentials = (data / "demo-credentials.txt").read_text()
        username, password = re.search(r"username (\S+), password (\S+)", credentials).groups()
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1360, "height": 860}, accept_downloads=True)
            page.goto(f"{base}/login/")
            page.fill("#id_username", username)
            page.fill("#id_password", password)
            page.click("button[type=submit]")
            page.goto(f"{base}/saes/groups/new/")
            page.fill("#group-hooks", "blocks.1.hook_resid_post blocks.2.hook_resid_post")
            page.fill("#group-variants", "k=8\nk=16\nk=32\nk=64")
            page.fill("#group-tokens", str(args.tokens))
            page.fill("#group-name", "demo: 2 hooks x 4 k")
            page.uncheck("#group-analyze")
            page.click("#group-submit")
            page.wait_for_url(re.compile(r"/saes/groups/grp_\w+/$"))
            step("group of 8 queued")
            expect(page.locator('[data-testid="group-status"]')).to_have_text("completed", timeout=1_800_000)
            step("group trained")
            page.click("#group-saebench")
            page.wait_for_url(re.compile(r"/saes/compare/\?group=grp_\w+$"))
            page.check("#bench-probing")
            page.click("#bench-start")
            page.wait_for_url(re.compile(r"/saes/compare/\?run=sb_\w+$"))
            step("SAEBench run queued (core + sparse probing on the demo's topics)")
            expect(page.locator('[data-testid="run-status"]')).to_have_text("completed", timeout=1_800_000)
            step("SAEBench run completed")
            page.click('th[data-column="core.ce_loss_score"] a')
            expect(page.locator("#compare-table")).to_have_attribute("data-sort", "core.ce_loss_score")
            rows = page.locator("#compare-table tbody tr")
            print(f"{rows.count()} SAEs compared")
            for row in rows.all():
                cells = row.locator("td").all_inner_texts()
                print("   ", " | ".join(cell.replace("\n", " ")[:40] for cell in cells[:8]))
            with page.expect_download() as download:
                page.locator('[data-export="core"]').first.click()
            document = json.loads(Path(download.value.path()).read_text())
            details = len(document["eval_result_details"])
            print("downloaded", download.value.suggested_filename, "with", details, "features' details")
            for scheme in ("light", "dark"):
                page.emulate_media(color_scheme=scheme)
                page.screenshot(path=str(SCREENSHOTS / f"saebench-compare-demo-{scheme}.png"), full_page=True)
            browser.close()
        step("sorted, exported, screenshots taken")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
