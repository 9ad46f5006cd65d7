"""The site console (``fedsgld site console``): what it shows, and who may change what.

After a short in-process run through the deployed ClientApp's guard, the page shows the
epsilon the ledger holds and one line per request, a refusal with its reason, never a path
of the site's; a request without the token and a POST without the CSRF token are refused;
approving a changed bundle on the page lets the site's bundle check pass it. The browser
tests drive Debian's chromium with Selenium (skipped, saying why, where it is missing).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_site_guard import LOCAL, Node, answered, evaluation, plan, policy_file, refused

from fedsgld.clients import approval, approve, audit_log
from fedsgld.clients.approval import NotApproved, check_bundle
from fedsgld.clients.audit_verify import verify
from fedsgld.clients.policy import SitePolicy

ROOT = Path(__file__).resolve().parents[2]


def _fab(line: str = "") -> bytes:
    from flwr.cli.build import build_fab_from_files

    files = {
        "pyproject.toml": (ROOT / "pyproject.toml").read_bytes(),
        "fedsgld/x.py": line.encode(),
    }
    return build_fab_from_files(files)[0]


@pytest.fixture(scope="module")
def _site_dir(tmp_path_factory) -> Path:
    """A site after a short run: two answered rounds, a refused replay, one evaluation; an
    approved bundle and a changed one the site refused (both kept beside the policy)."""
    tmp = tmp_path_factory.mktemp("console")
    pol = policy_file(tmp, min_noise_multiplier=0.3)
    node = Node({"site-id": 0, "privacy-policy": pol})
    answered(node.send("train", plan=plan(LOCAL, round=0)))
    answered(node.send("train", plan=plan(LOCAL, round=1)))
    refused(node.send("train", plan=plan(LOCAL, round=0)), "already answered")
    answered(node.send("evaluate", **evaluation([np.zeros(54595, np.float32)], config=LOCAL)))
    good, changed = _fab(), _fab("print('changed')\n")
    fab = tmp / "good.fab"
    fab.write_bytes(good)
    approve.approve(fab, pol)
    node_config = {"privacy-policy": pol, "site-id": 0}
    check_bundle(node_config, good, env={})
    with pytest.raises(NotApproved):
        check_bundle(node_config, changed, env={})
    return tmp / "policy"


@pytest.fixture
def site(_site_dir, tmp_path) -> Path:
    """A copy of the site's directory of the test's own; returns its policy file."""
    shutil.copytree(_site_dir, tmp_path / "policy")
    return tmp_path / "policy" / "policy.toml"


def _client(policy: Path, **kw):
    from starlette.testclient import TestClient

    from fedsgld.cli.console import Console, build_app

    console = Console(policy, **kw)
    return console, TestClient(build_app(console), base_url="http://127.0.0.1")


def _ledger_epsilon(policy: Path) -> float:
    from fedsgld.clients.audit_verify import ledgers

    (led,) = ledgers(SitePolicy.from_file(policy)).values()
    return led.accountant.rigorous_epsilon()


def test_the_page_shows_the_ledger_and_every_request_and_no_path(site):
    console, client = _client(site)
    html = client.get(f"/?token={console.token}").text
    assert f"{_ledger_epsilon(site):.6g}" in html
    assert len(re.findall(r"<tr class='entry", html)) == 7  # 3 requests charged: 2 lines each
    assert "already answered round 1" in html
    assert str(site.parent) not in html and "fedsgld-site-" not in html and ".npz" not in html
    assert client.get("/plot.png").headers["content-type"] == "image/png"  # the cookie serves
    refused_only = client.get("/?refused=1").text
    assert len(re.findall(r"<tr class='entry", refused_only)) == 1


def test_no_token_no_page_and_no_csrf_no_change(site):
    console, client = _client(site)
    for url in ("/", "/plot.png", "/?token=wrong"):
        assert client.get(url).status_code == 403
    assert client.post("/revoke", data={"sha256": "0" * 64}).status_code == 403
    before = site.read_text()
    client.get(f"/?token={console.token}")
    (sha,) = [a.sha256 for a in approval.read_approved(site)]
    assert client.post("/revoke", data={"sha256": sha}).status_code == 403  # no CSRF token
    assert client.post("/revoke", data={"sha256": sha, "csrf": "x"}).status_code == 403
    assert site.read_text() == before
    log = [e for _, _, e in audit_log.read(audit_log.audit_path(site.parent))]
    assert [(e["type"], e["decision"]) for e in log[-2:]] == [("console.revoke", "refused")] * 2
    ro, ro_client = _client(site, read_only=True)
    ro_client.get(f"/?token={ro.token}")
    html = ro_client.get("/").text
    assert "<button type='submit' id='revoke" not in html
    assert ro_client.post("/revoke", data={"sha256": sha, "csrf": ro.csrf}).status_code == 403
    assert site.read_text() == before


def test_approving_on_the_page_lets_the_changed_bundle_through_and_is_logged(site):
    console, client = _client(site)
    html = client.get(f"/?token={console.token}").text
    assert "changed: <code>fedsgld/x.py</code>" in html  # the difference from the approved one
    changed = _fab("print('changed')\n")
    node_config = {"privacy-policy": str(site), "site-id": 0}
    with pytest.raises(NotApproved):
        check_bundle(node_config, changed, env={})
    sha = approval.bundle_info(changed).sha256
    r = client.post("/approve", data={"sha256": sha, "csrf": console.csrf}, follow_redirects=False)
    assert r.status_code == 303
    assert check_bundle(node_config, changed, env={}) is not None
    text = site.read_text()
    assert approve.approval_entry(approval.bundle_info(changed)) in text  # as `site approve`
    r = client.post("/revoke", data={"sha256": sha, "csrf": console.csrf}, follow_redirects=False)
    assert r.status_code == 303
    with pytest.raises(NotApproved):
        check_bundle(node_config, changed, env={})
    log = [e for _, _, e in audit_log.read(audit_log.audit_path(site.parent))]
    assert [e["type"] for e in log[-2:]] == ["console.approve", "console.revoke"]
    assert verify(SitePolicy.from_file(site))[1] is None


# -- in a real browser ---------------------------------------------------------------------


def _browser():
    """Selenium's Chrome driver on Debian's chromium, or a skip saying what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or (
        "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None
    )
    if chromium is None or driver is None:
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (.ci/run installs them)"
        )
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1200,1600",
    ):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(driver), options=opts)


def _serve(console) -> tuple[str, object]:
    import uvicorn

    from fedsgld.cli.console import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(build_app(console), host="127.0.0.1", port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


@pytest.mark.slow
def test_the_console_in_chromium(site):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from fedsgld.cli.console import Console

    console = Console(site)
    url, server = _serve(console)
    browser = _browser()
    try:
        browser.get(f"{url}/")
        assert "needs its token" in browser.page_source
        browser.get(f"{url}/?token={console.token}")
        spent = browser.find_element(By.CSS_SELECTOR, "td.spent").text
        assert float(spent) == pytest.approx(_ledger_epsilon(site), rel=1e-5)
        assert (
            len(browser.find_elements(By.CSS_SELECTOR, "tr.entry")) == 7
        )  # 3 charged: 2 lines each
        reasons = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "tr.refused td.reason")]
        assert any("already answered round 1" in r for r in reasons)
        assert str(site.parent) not in browser.page_source
        browser.save_screenshot(
            str(Path(os.environ.get("FEDSGLD_SCREENSHOT_DIR", site.parent)) / "site-console.png")
        )
        changed = _fab("print('changed')\n")
        sha = approval.bundle_info(changed).sha256
        browser.find_element(By.ID, f"approve-{sha[:12]}").click()
        WebDriverWait(browser, 20).until(  # the page after the redirect lists it as approved
            lambda b: b.find_elements(By.ID, f"revoke-{sha[:12]}")
        )
        assert check_bundle({"privacy-policy": str(site), "site-id": 0}, changed, env={})
        browser.find_element(By.NAME, "run").send_keys("attacker")
        browser.find_element(By.NAME, "refused").click()
        browser.find_element(By.CSS_SELECTOR, "form[method='get'] button").click()
        WebDriverWait(browser, 20).until(
            lambda b: len(b.find_elements(By.CSS_SELECTOR, "tr.entry")) == 1
        )
    finally:
        browser.quit()
        server.should_exit = True
