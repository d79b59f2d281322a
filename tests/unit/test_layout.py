"""The storage layout (hybridflow.layout) names every path exactly as the code it replaced did: run directories and
report paths are persisted (reruns reattach by path), so old == new is checked over a wide table of run ids."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hybridflow.layout import StorageLayout, TrainingRunDir, safe_segment
from hybridflow.notifiers.oncall import default_alerts_file
from hybridflow.pipeline.registry import ModelRegistry


# The sanitisers the layout replaced, verbatim: pipeline/nightly.run_key (training run dirs, report folders) and
# pipeline/routing.run_dir_for (router run dirs).
def old_run_key(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id).strip("_.") or "run"


def old_router_run_dir(storage_root: str, run_id: str) -> str:
    return f"{storage_root}/runs/router/{re.sub(r'[^A-Za-z0-9._-]+', '_', run_id)}"


RUN_IDS = [
    "scheduled__2026-03-04T02:00:00+00:00", "manual__2026-01-05T00:00:00.123+00:00",
    "backfill__2026-01-01T00:00:00+00:00", "asset_triggered__2026-01-02T03:04:05.678901+00:00",
    "", ".", "..", "...", "_", "__", "/", "../../etc", "a/b/c", "/abs/path", "a b;c", "  spaces  ", "tab\there",
    "new\nline", "colon:only", "+", "++", "a+b", ":", "_leading", "trailing_", ".hidden", "a..b", "-dash", "~tilde",
    "%2F", "nul\x00byte", "back\\slash", "ünïcødé-run", "日本語", "emoji🚀run", "x" * 300, "ü" * 300, "a:" * 200,
    "run_id-with.dots_and-dashes", "UPPER.lower-123",
]
# Deterministic random strings over ASCII, separators, dots, whitespace, control and non-ASCII characters.
ALPHABET = "aZ09_-.:+/\\ \t\n~%$;'\"\x00\x7füé日本🚀"
SAMPLED = ["".join(random.Random(n).choices(ALPHABET, k=n % 41)) for n in range(2000)]
ROOTS = ["/var/lib/hybridflow/storage", "/st", "/trailing/", "relative/root", "/with space/ü"]


@pytest.mark.parametrize("run_id", RUN_IDS, ids=lambda run_id: ascii(run_id)[:60])
def test_safe_segment_is_the_run_key_it_replaced(run_id):
    assert safe_segment(run_id) == old_run_key(run_id)


@pytest.mark.parametrize("run_id", RUN_IDS, ids=lambda run_id: ascii(run_id)[:60])
def test_untrimmed_safe_segment_names_router_run_dirs_as_before(run_id):
    assert StorageLayout("/st").router_run_dir(run_id) == old_router_run_dir("/st", run_id)


def test_both_sanitisers_match_the_old_ones_on_random_run_ids():
    assert [safe_segment(run_id) for run_id in SAMPLED] == [old_run_key(run_id) for run_id in SAMPLED]
    assert ([StorageLayout("/st").router_run_dir(run_id) for run_id in SAMPLED]
            == [old_router_run_dir("/st", run_id) for run_id in SAMPLED])


@pytest.mark.parametrize(("run_id", "segment"), [
    ("scheduled__2026-03-04T02:00:00+00:00", "scheduled__2026-03-04T02_00_00_00_00"),
    ("../../etc", "etc"), ("a b;c", "a_b_c"), ("", "run"), ("..", "run"), ("ü", "run"),
])
def test_safe_segment_is_one_plain_path_segment(run_id, segment):
    assert safe_segment(run_id) == segment


@pytest.mark.parametrize(("run_id", "run_dir"), [
    ("manual__2026-01-05T00:00:00.123+00:00", "/st/runs/router/manual__2026-01-05T00_00_00.123_00_00"),
    ("../../etc", "/st/runs/router/.._.._etc"),
])
def test_router_run_dir_is_one_directory_per_run(run_id, run_dir):
    assert StorageLayout("/st").router_run_dir(run_id) == run_dir


@pytest.mark.parametrize("root", ROOTS)
def test_run_and_report_paths_are_the_ones_written_by_hand_before(root):
    layout, ds = StorageLayout(root), "2026-01-05"
    for run_id in RUN_IDS + SAMPLED[:200]:
        assert layout.training_run(ds, run_id).root == f"{root}/runs/nightly_training/ds={ds}/{old_run_key(run_id)}"
        assert layout.router_run_dir(run_id) == old_router_run_dir(root, run_id)
        relative = f"nightly_training/ds={ds}/{old_run_key(run_id)}"  # what RunReportOperator wrote
        assert layout.report_path("nightly_training", ds, run_id) == relative
        assert Path(layout.report_dir("nightly_training", ds, run_id)) == Path(root) / "reports" / relative


@pytest.mark.parametrize("root", ROOTS)
def test_dataset_log_and_preflight_paths_are_the_ones_written_by_hand_before(root):
    layout = StorageLayout(root)
    for dataset in ("raw", "features", "predictions"):
        assert Path(layout.partition(dataset, "2026-01-05")) == Path(root) / dataset / "ds=2026-01-05"
        assert layout.dataset(dataset) == f"{root}/{dataset}"
    for dag in ("preflight", "healthcheck", "reliability_probe"):
        assert layout.run_logs(dag) == f"{root}/runs/{dag}/logs"
    for nodes, ranks in ((1, 2), (2, 1), ("{{ params.nodes }}", "{{ params.gpus_per_node }}")):
        assert layout.preflight_result(nodes, ranks) == f"{root}/runs/preflight/{nodes}x{ranks}/latest.json"


@pytest.mark.parametrize("root", ROOTS)
def test_model_paths_are_the_registrys(root):
    layout, registry = StorageLayout(root), ModelRegistry(None, root, "propensity")
    assert Path(layout.model_dir("propensity")) == registry.root
    assert Path(layout.model_version_dir("propensity", 7, "ab" * 32)) == registry.version_dir(7, "ab" * 32)
    assert registry.version_dir(7, "ab" * 32).name == "v7-abababababab"
    assert layout.legacy_model_registry("propensity") == f"{root}/models/propensity/registry.json"
    assert f"file://{layout.model_dir('propensity')}" == f"file://{root}/models/propensity"  # the DAG's asset URI


def test_alerts_file_is_the_notifiers_default(tmp_path, monkeypatch):
    monkeypatch.delenv("HYBRIDFLOW_ALERTS_FILE", raising=False)
    monkeypatch.setenv("HYBRIDFLOW_STORAGE_ROOT", str(tmp_path))
    assert Path(StorageLayout(str(tmp_path)).alerts_file) == default_alerts_file()


@pytest.mark.parametrize("root", [None, "/data/lake", "/data/lake/"])
def test_config_layout_and_the_ui_read_the_storage_root_as_before(root, monkeypatch):
    """The UI read HYBRIDFLOW_STORAGE_ROOT itself; the config's root comes from the same variable and default."""
    from hybridflow.config import pipeline_config
    from hybridflow.ui import reports_root

    if root is None:
        monkeypatch.delenv("HYBRIDFLOW_STORAGE_ROOT", raising=False)
    else:
        monkeypatch.setenv("HYBRIDFLOW_STORAGE_ROOT", root)
    pipeline_config.cache_clear()
    try:
        config = pipeline_config()
        assert config.storage.layout == StorageLayout(config.storage.root)
        assert reports_root() == Path(root or "/var/lib/hybridflow/storage") / "reports"
    finally:
        pipeline_config.cache_clear()


# Every member of a training run's directory, as the operator, the DAG and the nightly tasks spelled it by hand.
RUN = "/st/runs/nightly_training/ds=2026-01-05/scheduled__2026-01-05T00_00_00_00_00"
TEMPLATE = "{{ ti.xcom_pull(task_ids='training.prepare')['run_dir'] }}"


@pytest.mark.parametrize(("member", "relative"), [
    ("config", "/config.json"),
    ("logs", "/logs"),
    ("progress", "/progress.json"),
    ("heartbeats", "/heartbeats"),
    ("metrics", "/metrics.json"),
    ("step_metrics", "/step_metrics.jsonl"),
    ("evaluation", "/evaluation.json"),
    ("checkpoints", "/checkpoints"),
    ("export", "/export"),
    ("model", "/export/model.pt"),
    ("mlflow_run", "/mlflow_run.json"),
    ("credentials", "/.mlflow-credentials.json"),
])
@pytest.mark.parametrize("root", [RUN, f"{RUN}.retrain-2", TEMPLATE])
def test_training_run_members_are_the_paths_written_by_hand_before(root, member, relative):
    """A templated root gives the template of the member: the DAG's rendered paths stay what they were."""
    assert getattr(TrainingRunDir(root), member) == root + relative


@pytest.mark.parametrize(("name", "path"), [
    ("model.pt", f"{RUN}/export/model.pt"),
    ("signature.json", f"{RUN}/export/signature.json"),
    ("smoke.json", f"{RUN}/export/smoke.json"),
])
def test_training_run_export_files(name, path):
    assert TrainingRunDir(RUN).export_file(name) == path


@pytest.mark.parametrize(("gen", "root"), [
    (0, RUN),
    (1, f"{RUN}.retrain-1"),
    (7, f"{RUN}.retrain-7"),
])
def test_a_generations_members_live_in_its_own_directory(gen, root):
    run = StorageLayout("/st").training_run("2026-01-05", "scheduled__2026-01-05T00:00:00+00:00").for_generation(gen)
    assert run == TrainingRunDir(root)
    assert run.checkpoints == f"{root}/checkpoints" and run.for_generation(gen) == run  # idempotent
