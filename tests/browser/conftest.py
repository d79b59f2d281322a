"""A real browser (Debian's headless chromium + chromedriver, driven by selenium) on the local Airflow UI.

`make test` installs chromium and chromium-driver (scripts/stack/system.py's ensure_packages) and selenium
(the [test] extra); when any is missing these tests fail saying so rather than skip. On a failure the test's
tmp dir gets a screenshot and the page source.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from airflow_api import AirflowApi, local_api
from helpers import rest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WINDOW = (1600, 1000)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


class Rest:
    """local_api() plus what these tests need and it lacks: the HTTP status of a refusal, DELETE, 404."""

    def __init__(self, api: AirflowApi):
        self.api = api

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        return rest.call(self.api, method, path, body)

    def run(self, dag_id: str, run_id: str) -> dict | None:
        path = f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}"
        status, body = self.call("GET", path)
        if status == 404:
            return None
        assert status == 200, f"GET run {run_id}: HTTP {status} {body}"
        return body

    def recent_runs(self, dag_id: str, limit: int = 50) -> list[dict]:
        return self.api.get(f"/api/v2/dags/{dag_id}/dagRuns?limit={limit}&order_by=-run_after")["dag_runs"]

    def remove_run(self, dag_id: str, run_id: str) -> None:
        rest.remove_run(self.api, dag_id, run_id)


def wait_for_ui(base_url: str, timeout_s: float = 180) -> None:
    """The api-server restarts when `make up` finds its environment changed; wait for it rather than fail."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(base_url + "/api/v2/monitor/health", timeout=10) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the Airflow api-server at {base_url} did not answer within {timeout_s:.0f} s")
        time.sleep(2)


@pytest.fixture(scope="session")
def airflow(stack) -> Rest:
    wait_for_ui(stack["AIRFLOW__API__BASE_URL"].rstrip("/"))
    return Rest(local_api())


@pytest.fixture(scope="session")
def admin_password(stack) -> str:
    return json.loads(Path(stack["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]).read_text())["admin"]


# Module scope, not session: the Airflow UI page left open keeps polling and rendering, and a headless Chromium
# left on it until the session ends burned a third of a core for the rest of the suite (measured, 23 CPU-minutes
# in one 70-minute run).
@pytest.fixture(scope="module")
def driver():
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: `make test` installs them (scripts/stack/system.py's "
                    "ensure_packages), or: apt-get install -y --no-install-recommends chromium "
                    "chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is missing: `make test` installs it (pyproject's [test] extra), "
                    "or: .venv/bin/pip install -e '.[test]'")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--disable-extensions", f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(arg)
    # An explicit driver path keeps Selenium Manager from looking for (or downloading) one.
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    browser.set_page_load_timeout(60)
    yield browser
    browser.quit()


@pytest.fixture(autouse=True)
def evidence_on_failure(request, tmp_path):
    """A failed test leaves screenshot.png and page.html in its pytest tmp dir (the report prints where)."""
    yield
    report = getattr(request.node, "rep_call", None) or getattr(request.node, "rep_setup", None)
    if report is None or not report.failed or "driver" not in request.fixturenames:
        return
    browser = request.getfixturevalue("driver")
    try:
        browser.save_screenshot(str(tmp_path / "screenshot.png"))
        (tmp_path / "page.html").write_text(browser.page_source)
        print(f"\nbrowser evidence: {tmp_path}/screenshot.png, page.html (at {browser.current_url})")
    except Exception as exc:  # the browser itself may be what broke
        print(f"\nno browser evidence saved: {exc}")


@pytest.fixture(scope="module")
def log_in(driver, admin_password, stack):
    """Signs in on the simple auth manager's own login page, as a person would, landing on the path given;
    returns the UI's base URL."""
    base = stack["AIRFLOW__API__BASE_URL"].rstrip("/")

    def sign_in(next_path: str) -> str:
        _sign_in(driver, base, admin_password, next_path)
        return base

    return sign_in


def _sign_in(driver, base: str, password: str, next_path: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{base}/auth/login?next={urllib.parse.quote(next_path, safe='')}")
    WebDriverWait(driver, 30).until(EC.visibility_of_element_located((By.NAME, "username"))).send_keys("admin")
    driver.find_element(By.NAME, "password").send_keys(password)
    driver.find_element(By.XPATH, "//form//button[normalize-space()='Sign in']").click()
    WebDriverWait(driver, 30).until(lambda d: "/auth/login" not in d.current_url)
