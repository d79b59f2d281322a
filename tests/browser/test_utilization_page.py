"""The GPU utilization page (the suite's plugin) in a real browser behind Airflow's login: today's ledger row,
computed from the real Slurm accounting and stored as the cluster_utilization DAG stores it, drawn as four charts
and a table; the page is also in the UI's Browse menu."""

from __future__ import annotations

from datetime import datetime

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.integration]


@pytest.fixture
def todays_row(slurm):
    from hybridflow.config import pipeline_config
    from hybridflow.pipeline.utilization import compute_days

    config = pipeline_config()
    now = datetime.fromtimestamp(float(slurm.run(["date", "+%s"]).stdout))
    [stored] = compute_days(slurm, config.storage.layout, ["gpu-training"], [now.date()], now)
    return stored


def test_the_page_draws_its_charts_behind_the_login(driver, log_in, todays_row, stack):
    base = stack["AIRFLOW__API__BASE_URL"].rstrip("/")
    driver.get(f"{base}/hybridflow/utilization")
    assert "GPU utilization" not in driver.title  # not signed in yet: refused, nothing drawn
    log_in("/hybridflow/utilization")
    driver.get(f"{base}/hybridflow/utilization")
    WebDriverWait(driver, 30).until(lambda d: d.title == "GPU utilization")
    charts = driver.find_elements(By.CSS_SELECTOR, "svg[role=img]")
    assert [chart.get_attribute("aria-label") for chart in charts] == [
        "Utilization per day (allocated / available GPU-hours)", "GPU-hours by DAG",
        "Queue wait of GPU jobs (p50, p95)", "CPU efficiency of GPU jobs"]
    assert all(chart.size["width"] > 600 and chart.size["height"] > 200 for chart in charts)  # laid out, visible
    target = driver.find_element(By.CSS_SELECTOR, "line.target")
    assert driver.execute_script("return arguments[0].getBoundingClientRect().width", target) > 600
    today = driver.find_element(By.XPATH, f"//table//td[starts-with(., '{todays_row['day']}')]")
    assert today.text == f"{todays_row['day']} (so far)"
    shown = today.find_element(By.XPATH, "following-sibling::td[1]").text
    assert shown == (f"{todays_row['utilization']:.1%}" if todays_row["utilization"] is not None else "not measured")
