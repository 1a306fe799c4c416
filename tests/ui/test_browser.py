"""The console in a real headless browser: Debian's Chromium driven by Selenium.

The :mod:`tests.ui.world` app is served by uvicorn on a free loopback port and a
headless Chromium signs in, filters, opens, replays, tunes and signs out the way
an operator would. Screenshots go to ``$RAGBUDGET_UI_SCREENSHOTS`` when it is set
(``scripts/ui_screenshots.sh`` sets it to ``docs/ui``), else to a temporary folder.

The browser is Debian's ``chromium`` + ``chromium-driver`` (``scripts/test.sh``
installs them); Selenium is pointed at ``/usr/bin/chromedriver`` so it never tries
to download one. When they cannot be found the tests skip with the reason, unless
``RAGBUDGET_REQUIRE_BROWSER=1`` (set by ``scripts/test.sh`` once the install
succeeded), which turns a missing browser into a failure.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from latency_model.profile import Profile
from tests.ui.world import QUESTIONS, ConsoleWorld, build_world

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("RAGBUDGET_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("RAGBUDGET_CHROMEDRIVER", "/usr/bin/chromedriver")
WAIT_S = 20


def _unavailable() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e .[dev])"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (Path(path).is_file() and os.access(path, os.X_OK)):
            return f"{path} not found: install Debian's chromium and chromium-driver (scripts/test.sh does)"
    return None


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("RAGBUDGET_REQUIRE_BROWSER") == "1":
        pytest.fail(f"RAGBUDGET_REQUIRE_BROWSER=1 but the browser cannot run: {reason}")
    pytest.skip(f"browser tests skipped: {reason}")


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory,
           ui_profile: Profile) -> Iterator[tuple[ConsoleWorld, str, _Captured]]:
    """The world's app under uvicorn (access log on and captured) at ``http://127.0.0.1:<port>``."""
    reason = _unavailable()
    if reason:
        _skip_or_fail(reason)
    import uvicorn

    world = build_world(tmp_path_factory.mktemp("browser"), ui_profile)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    captured = _Captured()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.access", "uvicorn.error", "ragbudget", "")]
    server = uvicorn.Server(uvicorn.Config(world.app, host="127.0.0.1", port=port, log_level="info",
                                           access_log=True, lifespan="off"))
    thread = threading.Thread(target=server.run, name="uvicorn-console", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            pytest.fail("uvicorn did not start")
        time.sleep(0.05)
    for lg in loggers:  # after uvicorn configured its loggers
        lg.addHandler(captured)
    yield world, f"http://127.0.0.1:{port}", captured
    for lg in loggers:
        lg.removeHandler(captured)
    server.should_exit = True
    thread.join(15)
    world.services.close()


@pytest.fixture(scope="module")
def browser(served: Any) -> Iterator[Any]:
    """One headless Chromium for the module (fresh, empty profile; no network beyond loopback)."""
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    profile_dir = tempfile.mkdtemp(prefix="rb-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1",
                f"--user-data-dir={profile_dir}", "--window-size=1280,900"):
        opts.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    except WebDriverException as exc:
        shutil.rmtree(profile_dir, ignore_errors=True)
        _skip_or_fail(f"Chromium did not start: {exc.msg}")
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
    shutil.rmtree(profile_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def shots() -> Path:
    """Where screenshots go (``$RAGBUDGET_UI_SCREENSHOTS`` or a temporary folder)."""
    target = os.environ.get("RAGBUDGET_UI_SCREENSHOTS")
    path = Path(target) if target else Path(tempfile.mkdtemp(prefix="rb-ui-shots-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _shot(driver: Any, folder: Path, name: str, width: int = 1280, full: bool = True) -> None:
    """Screenshot the page at ``width`` px; ``full`` grows the window to the page height (max 3000)."""
    height = 900 if width > 600 else 844
    driver.set_window_size(width, height)
    if full:
        total = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(width, min(max(int(total) + 120, height), 3000))
    driver.save_screenshot(str(folder / f"{name}.png"))
    driver.set_window_size(1280, 900)


def _wait(driver: Any, css: str) -> Any:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S).until(ec.presence_of_element_located((By.CSS_SELECTOR, css)))


def _submit_filters(driver: Any) -> None:
    """Click "apply filters" and wait for the new page: the old table gone stale, then the
    new one present (reading rows in between would read the page being replaced)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    old = driver.find_element(By.ID, "receipts")
    driver.find_element(By.ID, "apply-filters").click()
    WebDriverWait(driver, WAIT_S).until(ec.staleness_of(old))
    _wait(driver, "#receipts")


def _sign_in(driver: Any, base: str, key: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/ui/login")
    field = _wait(driver, "#api_key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.ID, "sign-in").click()


def _signed_in(driver: Any, base: str, key: str) -> None:
    driver.get(f"{base}/ui/receipts")
    if "/ui/login" in driver.current_url:
        _sign_in(driver, base, key)
        _wait(driver, "#receipts")


def test_a_copilot_key_is_refused(served, browser, shots):
    world, base, _ = served
    _sign_in(browser, base, world.keys["copilot"])
    error = _wait(browser, "#login-error")
    assert "cannot sign in" in error.text
    assert not browser.get_cookie("rb_console")
    _shot(browser, shots, "login-copilot-refused", full=False)
    browser.get(f"{base}/ui/receipts")
    _wait(browser, "#api_key")
    assert "/ui/login" in browser.current_url


def test_sign_in_with_an_operator_key(served, browser, shots):
    from selenium.webdriver.common.by import By

    world, base, _ = served
    browser.delete_all_cookies()
    browser.get(f"{base}/ui/login")
    _wait(browser, "#api_key")
    _shot(browser, shots, "login", full=False)
    _sign_in(browser, base, world.keys["operator"])
    _wait(browser, "#receipts")
    assert browser.current_url == f"{base}/ui/receipts"
    assert "operator key (operator)" in browser.find_element(By.ID, "who").text
    cookie = browser.get_cookie("rb_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    secret = world.keys["operator"].split("_", 2)[2]
    assert secret not in browser.page_source and secret not in browser.current_url


def test_list_and_filter_receipts(served, browser, shots):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    world, base, _ = served
    _signed_in(browser, base, world.keys["operator"])
    rows = browser.find_elements(By.CSS_SELECTOR, "#receipts tbody tr[data-receipt]")
    assert len(rows) == 4
    _shot(browser, shots, "receipts")
    Select(browser.find_element(By.ID, "within")).select_by_value("no")
    _submit_filters(browser)
    rows = browser.find_elements(By.CSS_SELECTOR, "#receipts tbody tr[data-receipt]")
    assert [r.get_attribute("data-receipt") for r in rows] == [world.over_budget]
    assert "within=no" in browser.current_url
    _shot(browser, shots, "receipts-over-budget", full=False)
    browser.find_element(By.ID, "document").send_keys("no/such.md")
    _submit_filters(browser)
    assert browser.find_elements(By.CSS_SELECTOR, "#receipts tbody tr[data-receipt]") == []


def test_open_a_receipt_and_replay_it_with_every_check_ok(served, browser, shots):
    from selenium.webdriver.common.by import By

    world, base, _ = served
    _signed_in(browser, base, world.keys["operator"])
    rid = world.receipts[1]
    browser.find_element(By.CSS_SELECTOR, f'tr[data-receipt="{rid}"] a').click()
    _wait(browser, "#receipt-id")
    assert browser.find_element(By.ID, "receipt-id").text == rid
    assert browser.find_element(By.ID, "question").text == QUESTIONS[1]
    assert browser.find_elements(By.CSS_SELECTOR, "#plan tr.chosen")
    _shot(browser, shots, "receipt")
    browser.find_element(By.ID, "regenerate").click()
    browser.find_element(By.ID, "replay").click()
    report = _wait(browser, "#replay-report")
    checks = {r.get_attribute("data-check"): r.get_attribute("data-status")
              for r in browser.find_elements(By.CSS_SELECTOR, "#replay-checks tr[data-check]")}
    assert report.get_attribute("data-ok") == "true"
    assert set(checks) >= {"receipt_hash", "chain_link", "corpus_root", "retrieval", "embedder",
                           "stored_chunks", "prompt", "regenerate"}
    assert set(checks.values()) == {"ok"}
    browser.execute_script("document.getElementById('replay-heading').scrollIntoView()")
    _shot(browser, shots, "replay", full=False)


def test_a_superseded_citation_shows_its_badge(served, browser, shots):
    from selenium.webdriver.common.by import By

    world, base, _ = served
    _signed_in(browser, base, world.keys["operator"])
    browser.get(f"{base}/ui/receipts/{world.superseded_receipt}")
    _wait(browser, "#receipt-id")
    badges = browser.find_elements(By.CSS_SELECTOR, '.chunk [data-freshness="superseded"]')
    assert badges and badges[0].is_displayed()
    assert badges[0].text == "superseded by v2 at revision 2"
    browser.execute_script("document.getElementById('cited-heading').scrollIntoView()")
    _shot(browser, shots, "receipt-superseded", full=False)


def test_the_tuning_page_draws_the_curve_and_marks_the_chosen_k(served, browser, shots):
    from selenium.webdriver.common.by import By

    world, base, _ = served
    _signed_in(browser, base, world.keys["operator"])
    browser.get(f"{base}/ui/tuning")
    browser.find_element(By.ID, "question").send_keys(QUESTIONS[0])
    browser.find_element(By.ID, "budget_ms").send_keys("800")
    browser.find_element(By.ID, "plan-button").click()
    _wait(browser, "#curve svg")
    chosen = browser.find_element(By.ID, "chosen").get_attribute("data-chosen-k")
    marker = browser.find_element(By.CSS_SELECTOR, "#curve svg #chosen-k")
    assert marker.is_displayed() and marker.size["width"] > 0
    assert browser.find_element(By.CSS_SELECTOR, "#curve svg #curve-p95").is_displayed()
    row = browser.find_element(By.CSS_SELECTOR, "#curve-table tr.chosen")
    assert row.get_attribute("data-k") == chosen
    assert browser.find_elements(By.CSS_SELECTOR, "#profile-plot svg #profile-fit")
    _shot(browser, shots, "tuning")


def test_corpus_diff_page(served, browser, shots):
    from selenium.webdriver.common.by import By

    world, base, _ = served
    _signed_in(browser, base, world.keys["operator"])
    browser.get(f"{base}/ui/corpus")
    _wait(browser, "#revisions")
    _shot(browser, shots, "corpus", full=False)
    browser.get(f"{base}/ui/corpus/documents/{world.superseded_document}")
    _wait(browser, "#diff")
    assert browser.find_elements(By.CSS_SELECTOR, "#diff .add")
    _shot(browser, shots, "document-diff", full=False)


def test_pages_fit_a_390_px_screen(served, browser, shots):
    world, base, _ = served
    _signed_in(browser, base, world.keys["operator"])
    browser.set_window_size(390, 844)
    try:
        for path in ("/ui/receipts", f"/ui/receipts/{world.receipts[0]}",
                     "/ui/tuning?question=backup&budget_ms=60000", "/ui/corpus"):
            browser.get(base + path)
            _wait(browser, "main")
            overflow = browser.execute_script(
                "return document.documentElement.scrollWidth - document.documentElement.clientWidth")
            assert overflow <= 0, f"{path} scrolls sideways by {overflow} px at 390 px"
        browser.get(f"{base}/ui/receipts/{world.receipts[0]}")
        _wait(browser, "#receipt-id")
        _shot(browser, shots, "receipt-390", width=390, full=False)
    finally:
        browser.set_window_size(1280, 900)


def test_controls_are_labelled_and_reachable_by_keyboard(served, browser):
    from selenium.webdriver.common.keys import Keys

    world, base, _ = served
    _signed_in(browser, base, world.keys["operator"])
    for path in ("/ui/receipts", f"/ui/receipts/{world.receipts[0]}", "/ui/tuning", "/ui/corpus"):
        browser.get(base + path)
        _wait(browser, "main")
        unlabelled = browser.execute_script(
            "return [...document.querySelectorAll('input:not([type=hidden]), select, textarea')]"
            ".filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')).map(e => e.name)")
        assert unlabelled == [], f"{path}: unlabelled controls {unlabelled}"
    browser.get(f"{base}/ui/receipts/{world.receipts[0]}")
    _wait(browser, "#replay")
    body = browser.switch_to.active_element
    seen = []
    for _ in range(60):
        body.send_keys(Keys.TAB)
        body = browser.switch_to.active_element
        seen.append(body.get_attribute("id") or body.get_attribute("href") or body.tag_name)
        if body.get_attribute("id") == "replay":
            break
    assert seen[-1] == "replay", f"Tab never reached the Replay button: {seen}"
    assert seen[0] is not None


def test_a_forged_form_without_the_csrf_token_is_refused(served, browser, shots):
    from selenium.webdriver.common.by import By

    world, base, _ = served
    _signed_in(browser, base, world.keys["operator"])
    rid = world.receipts[0]
    browser.get(f"{base}/ui/receipts/{rid}")
    _wait(browser, "#receipt-id")
    browser.execute_script(
        "document.body.insertAdjacentHTML('beforeend', arguments[0]);"
        "document.getElementById('forged').submit();",
        f'<form id="forged" method="post" action="/ui/receipts/{rid}/replay">'
        '<input type="hidden" name="regenerate" value="on"></form>')
    error = _wait(browser, "#error")
    assert error.get_attribute("data-code") == "csrf_failed"
    assert not browser.find_elements(By.ID, "replay-report")
    _shot(browser, shots, "csrf-refused", full=False)
    browser.get(f"{base}/ui/receipts")  # the session itself is untouched
    _wait(browser, "#receipts")


def test_sign_out_ends_the_session(served, browser):
    from selenium.webdriver.common.by import By

    world, base, _ = served
    _signed_in(browser, base, world.keys["operator"])
    old = browser.get_cookie("rb_console")["value"]
    browser.find_element(By.ID, "sign-out").click()
    notice = _wait(browser, "#notice")
    assert "signed out" in notice.text
    browser.get(f"{base}/ui/receipts")
    _wait(browser, "#api_key")
    assert "/ui/login" in browser.current_url
    browser.add_cookie({"name": "rb_console", "value": old, "path": "/ui"})  # replay the old cookie
    browser.get(f"{base}/ui/receipts")
    _wait(browser, "#api_key")
    assert "/ui/login" in browser.current_url


def test_no_key_ever_reached_the_server_log(served):
    world, _, captured = served
    assert captured.lines, "the server log captured nothing; the check would be empty"
    for key in world.keys.values():
        secret = key.split("_", 2)[2]
        assert not [line for line in captured.lines if secret in line]


_CSP_WATCH = ("window.__cspViolations = [];"
              "document.addEventListener('securitypolicyviolation', e => "
              "window.__cspViolations.push(e.violatedDirective + ' ' + e.blockedURI));")


@pytest.mark.parametrize(("path", "title", "operations"), [
    ("/docs", ".swagger-ui .info .title", ".opblock"),  # Swagger UI
    ("/redoc", ".api-content h1", ".menu-content li"),  # ReDoc
])
def test_api_docs_render_from_this_server_alone_under_their_policy(served, browser, shots, path, title,
                                                                    operations):
    _world, base, _ = served
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": _CSP_WATCH})
    browser.get(base + path)
    assert "ragbudget" in _wait(browser, title).text
    _wait(browser, operations)  # the operations, read from /openapi.json: the scripts ran
    # ReDoc's bundle always tries to show Redocly's logo from its CDN in the sidebar footer; the
    # policy blocks it before any request (img-src 'self' data:) and the image hides itself.
    # Nothing else is blocked: no script, style or connection was attempted elsewhere.
    violations = set(browser.execute_script("return window.__cspViolations"))
    assert violations <= {"img-src https://cdn.redoc.ly/redoc/logo-mini.svg"}, violations
    resources = browser.execute_script(
        "return performance.getEntriesByType('resource').map(r => r.name)")
    blocked = {v.split(" ", 1)[1] for v in violations}
    assert resources and all(r.startswith(base + "/") or r in blocked for r in resources), resources
    _shot(browser, shots, "api-docs" + path.replace("/", "-"), full=False)
