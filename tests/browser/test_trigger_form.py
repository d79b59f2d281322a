"""The nightly DAG's trigger form in the real Airflow UI: every param with its description, invalid values
refused, a valid (dry-run) trigger starting a run. The REST API is the oracle for what runs exist.

Every trigger here sets dry_run=true first, so even a form that let a bad value through would start a run that
plans and does nothing. Runs these tests create are deleted afterwards; a paused DAG is unpaused for the valid
trigger and paused again.
"""

from __future__ import annotations

import time
import uuid

import pytest
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.integration]

DAG_ID = "nightly_training"
PARAMS = ["train", "deploy", "model_preset", "nodes", "gpus_per_node", "device", "epochs", "max_steps",
          "train_window_days", "dry_run"]
TERMINAL = ("success", "failed")
WAIT_S = 30
TRIGGER_BUTTON = (By.CSS_SELECTOR, "button[aria-label='Trigger Dag']")
TRIGGER_DIALOG = "//*[@role='dialog'][.//*[starts-with(normalize-space(), 'Trigger Dag')]]"


def wait(driver, timeout: float = WAIT_S) -> WebDriverWait:
    return WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,))


@pytest.fixture(scope="module")
def ui(driver, airflow, log_in) -> str:
    """Logs in on the simple auth manager's own login page, as a person would; returns the UI's base URL."""
    base = log_in(f"/dags/{DAG_ID}")
    wait(driver).until(EC.element_to_be_clickable(TRIGGER_BUTTON))
    return base


@pytest.fixture
def dag_unpaused(airflow):
    was_paused = airflow.api.get(f"/api/v2/dags/{DAG_ID}")["is_paused"]
    if was_paused:
        airflow.api.patch(f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
    yield
    if was_paused:
        airflow.api.patch(f"/api/v2/dags/{DAG_ID}", {"is_paused": True})


@pytest.fixture
def run_id(airflow):
    """A run id of this test's own; a run carrying it is removed afterwards (rest.remove_run)."""
    rid = f"browser_test__{uuid.uuid4().hex[:12]}"
    yield rid
    airflow.remove_run(DAG_ID, rid)


def open_trigger_form(driver, base: str):
    driver.get(f"{base}/dags/{DAG_ID}")
    wait(driver).until(EC.element_to_be_clickable(TRIGGER_BUTTON)).click()

    def visible_dialog(d):
        for dialog in d.find_elements(By.XPATH, TRIGGER_DIALOG):
            if dialog.is_displayed():
                return dialog
        return False

    dialog = wait(driver).until(visible_dialog)
    wait(driver).until(lambda d: field(dialog, PARAMS[-1]).is_displayed())
    return dialog


def field(dialog, name: str):
    """A param's row in the form: its label (the param's name), its input, its helper text (description)."""
    return dialog.find_element(By.XPATH, f".//*[@role='group'][.//label[normalize-space(text())='{name}']]")


def submit_button(dialog):
    return dialog.find_element(By.XPATH, ".//footer//button[normalize-space()='Trigger']")


def turn_on_dry_run(driver, dialog) -> None:
    row = field(dialog, "dry_run")
    checkbox = row.find_element(By.CSS_SELECTOR, "input[type=checkbox]")
    if not checkbox.is_selected():
        # The switch's own control: its checkbox is visually hidden.
        row.find_element(By.CSS_SELECTOR, "[data-part=control]").click()
    wait(driver).until(lambda _: checkbox.is_selected())


def open_advanced_options(driver, dialog, run_id: str):
    """Sets the Run ID; returns the Configuration JSON editor's text area (Monaco)."""
    dialog.find_element(By.XPATH, ".//button[normalize-space()='Advanced Options']").click()
    run_id_input = wait(driver).until(lambda _: dialog.find_element(By.NAME, "dagRunId"))
    wait(driver).until(lambda _: run_id_input.is_displayed())
    run_id_input.send_keys(run_id)
    return wait(driver).until(lambda _: dialog.find_element(By.CSS_SELECTOR, ".monaco-editor .view-lines"))


def replace_text(element, value: str) -> None:
    element.send_keys(Keys.CONTROL, "a")  # a modifier stays down to the end of its send_keys call
    element.send_keys(Keys.BACKSPACE)
    if value:
        element.send_keys(value)


def text_of(element) -> str:
    return " ".join(element.text.split())


def test_trigger_form_shows_every_param_with_its_description(ui, driver, airflow):
    params = airflow.api.get(f"/api/v2/dags/{DAG_ID}/details")["params"]
    assert set(PARAMS) <= set(params), f"the DAG's params changed: {sorted(params)}"
    dialog = open_trigger_form(driver, ui)
    for name, spec in params.items():
        row = field(dialog, name)
        assert row.is_displayed(), f"param {name} is not shown"
        description = " ".join((spec.get("description") or "").split())
        assert description, f"param {name} has no description in the DAG"
        helper = row.find_element(By.CSS_SELECTOR, "[data-part=helper-text]")
        assert text_of(helper) == description, f"param {name}: the form says {text_of(helper)!r}"


def test_trigger_form_refuses_invalid_values(ui, driver, airflow, run_id):
    dialog = open_trigger_form(driver, ui)
    turn_on_dry_run(driver, dialog)
    gpus = field(dialog, "gpus_per_node").find_element(By.TAG_NAME, "input")
    default_gpus = gpus.get_attribute("value")

    # An empty required param: the form says so and will not submit.
    replace_text(gpus, "")
    field(dialog, "epochs").find_element(By.TAG_NAME, "input").click()
    wait(driver).until(lambda _: "This field is required" in text_of(field(dialog, "gpus_per_node")))
    assert not submit_button(dialog).is_enabled(), "Trigger is enabled with a required param empty"

    # Out of range in the field: the number input does not keep 99 (it clamps to the param's maximum, 8).
    gpus.send_keys("99")
    field(dialog, "epochs").find_element(By.TAG_NAME, "input").click()
    wait(driver).until(lambda _: gpus.get_attribute("value") != "99")
    assert gpus.get_attribute("value") == "8", f"gpus field holds {gpus.get_attribute('value')!r} after 99"
    wait(driver).until(lambda _: submit_button(dialog).is_enabled())

    # Out of range through the run's configuration JSON: the server refuses and the form shows why.
    replace_text(gpus, default_gpus)
    editor = open_advanced_options(driver, dialog, run_id)
    wait(driver).until(lambda _: f'"gpus_per_node": {default_gpus},' in editor.text)
    lines = editor.text.split("\n")
    row = next(i for i, line in enumerate(lines) if line.strip().startswith('"gpus_per_node"'))
    editor.click()
    keys = ActionChains(driver).key_down(Keys.CONTROL).send_keys(Keys.HOME).key_up(Keys.CONTROL)
    for _ in range(row):
        keys.send_keys(Keys.DOWN)
    keys.send_keys(Keys.END, Keys.LEFT, *[Keys.BACKSPACE] * len(default_gpus), "99").perform()
    wait(driver).until(lambda _: '"gpus_per_node": 99,' in editor.text)
    # Monaco renders only the lines in view (about 11 of the conf's 13): dry_run is at the end, so go there.
    ActionChains(driver).key_down(Keys.CONTROL).send_keys(Keys.END).key_up(Keys.CONTROL).perform()
    wait(driver).until(lambda _: '"dry_run": true' in editor.text)
    submit_button(dialog).click()
    refusal = wait(driver).until(EC.visibility_of_element_located(
        (By.XPATH, "//*[@role='dialog']//*[contains(text(), 'Invalid input for param gpus_per_node')]")))
    assert "maximum of 8" in refusal.text, refusal.text
    assert dialog.is_displayed(), "the trigger form closed although the run was refused"
    assert airflow.run(DAG_ID, run_id) is None, "a run was created with gpus_per_node=99"
    assert not [r for r in airflow.recent_runs(DAG_ID) if (r.get("conf") or {}).get("gpus_per_node") == 99]


def test_valid_trigger_starts_a_run(ui, driver, airflow, dag_unpaused, run_id):
    dialog = open_trigger_form(driver, ui)
    turn_on_dry_run(driver, dialog)
    open_advanced_options(driver, dialog, run_id)
    submit_button(dialog).click()

    # The UI takes us to the new run's page.
    wait(driver).until(lambda d: d.current_url.endswith(f"/dags/{DAG_ID}/runs/{run_id}"))
    wait(driver).until(lambda d: run_id in d.find_element(By.TAG_NAME, "body").text)

    run = airflow.run(DAG_ID, run_id)
    assert run is not None, "the UI showed the run, the REST API does not know it"
    assert run["run_type"] == "manual" and run["conf"].get("dry_run") is True, run

    deadline = time.monotonic() + 300
    while run["state"] not in TERMINAL and time.monotonic() < deadline:
        time.sleep(2)
        run = airflow.run(DAG_ID, run_id)
    active = [r["dag_run_id"] for r in airflow.recent_runs(DAG_ID) if r["state"] in ("queued", "running")]
    assert run["state"] == "success", f"dry run ended {run['state']!r} (runs active now: {active})"

    # ... and, reloaded, shows it finished.
    try:
        driver.refresh()
    except WebDriverException:
        driver.get(f"{ui}/dags/{DAG_ID}/runs/{run_id}")
    wait(driver).until(lambda d: "Success" in d.find_element(By.TAG_NAME, "body").text)
