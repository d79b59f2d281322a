"""Reliability scenarios on the Spark stages, on the real local Spark (local[2] and the standalone master).

6: an executor JVM is SIGKILLed mid-job; the standalone app relaunches one and still publishes exactly once.
8: the storage root fills up mid-write; the stage fails clearly and the previous partition is untouched.
9: malformed raw input is quarantined or fails with a clear error; features are never silently wrong.
Each scenario prints one `RELIABILITY <scenario> key=value ...` line (the README quotes them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from helpers.partitions import manifest, read
from helpers.spark import (
    DS,
    JOBS,
    RAW_NAMES,
    STANDALONE_MASTER,
    generate,
    job_env,
    require_standalone_master,
    spark_command,
)
from hybridjobs.features import FEATURE_COLUMNS

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def submit(script: str, *args: str, master: str = "local[2]", conf: dict[str, str] | None = None,
           timeout: int = 300) -> subprocess.Popen:
    return subprocess.Popen(spark_command(script, *args, master=master, conf=conf), env=job_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def features_job(root: Path, ds: str = DS, master: str = "local[2]",
                 conf: dict[str, str] | None = None) -> subprocess.Popen:
    return submit(str(JOBS / "build_features.py"), "--root", str(root), "--ds", ds, "--lookback-days", "1",
                  master=master, conf=conf)


def finish(proc: subprocess.Popen, timeout: int = 300) -> tuple[int, str, str]:
    """(rc, stdout, stdout + stderr): under spark-submit a driver's Python traceback may land on stdout."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, out + err


def tree_hashes(partition: Path) -> dict[str, str]:
    return {str(p.relative_to(partition)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(partition.rglob("*")) if p.is_file()}


def visible(dataset_dir: Path) -> list[str]:
    return sorted(p.name for p in dataset_dir.iterdir() if not p.name.startswith("."))


# --- 6: executor killed mid-job ---------------------------------------------------------------------------

def executor_pids(app_id: str | None = None) -> list[int]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split(None, 1)[0]) for line in out.splitlines()
            if "CoarseGrainedExecutorBackend" in line and (app_id is None or app_id in line)]


def app_id_of(pid: int) -> str | None:
    """The Spark application an executor JVM runs for (its ``--app-id`` argument); None once it is gone."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for flag, value in zip(args, args[1:], strict=False):
        if flag == b"--app-id":
            return value.decode()
    return None


def test_executor_killed_mid_job_is_replaced_and_output_is_exactly_once(cluster_tmp_path):
    require_standalone_master()
    rows, customers = 20_000, 5_000
    generate(cluster_tmp_path, DS, rows=rows, customers=customers)
    clean_root = cluster_tmp_path / "clean"
    (clean_root / "raw").mkdir(parents=True)
    os.symlink(cluster_tmp_path / "raw" / f"ds={DS}", clean_root / "raw" / f"ds={DS}")
    code, out, err = finish(features_job(clean_root, master=STANDALONE_MASTER))
    assert code == 0, err[-4000:]
    clean_rows = manifest(clean_root, "features", DS)["row_count"]

    before = set(executor_pids())
    started = time.monotonic()
    # Many small tasks keep the job busy long enough to kill its executor while tasks are in flight.
    job = features_job(cluster_tmp_path, master=STANDALONE_MASTER,
                       conf={"spark.sql.shuffle.partitions": "64", "spark.task.maxFailures": "4"})
    killed: list[int] = []
    app_id: str | None = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None:
        fresh = [p for p in executor_pids() if p not in before]
        if fresh:
            time.sleep(4)  # let it register and start running tasks
            app_id = app_id_of(fresh[0])
            if job.poll() is None:
                os.kill(fresh[0], signal.SIGKILL)
                killed.append(fresh[0])
            break
        time.sleep(0.2)
    killed_at = time.monotonic() - started
    # The replacement: a new executor JVM of the same application (another app's executors do not count).
    relaunched: list[int] = []
    while job.poll() is None and not relaunched:
        relaunched = [p for p in executor_pids(app_id) if p not in before and p not in killed]
        time.sleep(0.2)
    code, out, err = finish(job)
    seconds = time.monotonic() - started
    assert killed, "the job finished before an executor could be killed"
    assert app_id, f"could not read the --app-id of executor {killed[0]} before killing it"
    assert relaunched, (f"executor {killed[0]} of {app_id} was SIGKILLed at {killed_at:.1f} s, but no replacement "
                        f"executor of {app_id} was seen before the job ended (rc {code}, {seconds:.1f} s); the "
                        f"standalone master did not relaunch it.\n{err[-4000:]}")
    assert code == 0, f"job failed after the executor kill (rc {code}):\n{err[-6000:]}"
    table = read(cluster_tmp_path, "features", DS)
    distinct = len(pc.unique(table["customer_id"]))
    fm = manifest(cluster_tmp_path, "features", DS)
    lost = bool(re.search(r"Lost executor|ExecutorLostFailure|Executor .* (exited|removed)", err))
    print(f"RELIABILITY executor_kill killed_pid={killed[0]} killed_at_s={killed_at:.1f} "
          f"relaunched={bool(relaunched)} job_rc={code} job_s={seconds:.1f} rows={table.num_rows} "
          f"clean_rows={clean_rows} distinct_customers={distinct} driver_saw_loss={lost}")
    assert table.num_rows == fm["row_count"] == clean_rows == distinct
    assert visible(cluster_tmp_path / "features") == [f"ds={DS}"]


# --- 8: disk full on the output path ----------------------------------------------------------------------

def test_disk_full_fails_the_stage_clearly_and_keeps_the_previous_partition():
    mount_dir = Path(tempfile.mkdtemp(prefix="hybridflow-tmpfs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_dir)], check=True)
    try:
        root = mount_dir / "storage"
        generate(root, DS, rows=2_000, customers=200)
        code, out, err = finish(features_job(root))
        assert code == 0, err[-4000:]
        features_dir = root / "features" / f"ds={DS}"
        quarantine_dir = root / "quarantine" / f"ds={DS}"
        before = {"features": tree_hashes(features_dir), "quarantine": tree_hashes(quarantine_dir)}
        assert "_SUCCESS" in before["features"] and "_MANIFEST.json" in before["features"]

        generate(root, DS, rows=20_000, customers=5_000)
        free = os.statvfs(mount_dir)
        ballast_bytes = free.f_bavail * free.f_frsize - 96 * 1024  # leave less than the new output needs
        with open(mount_dir / "ballast", "wb") as handle:
            handle.truncate(0)
            handle.write(b"\0" * ballast_bytes)
        started = time.monotonic()
        code, out, err = finish(features_job(root))
        seconds = time.monotonic() - started
        no_space = "No space left on device" in err
        after = {"features": tree_hashes(features_dir), "quarantine": tree_hashes(quarantine_dir)}
        leftovers = sorted(p.name for p in (root / "features").iterdir() if p.name.startswith("."))
        print(f"RELIABILITY disk_full rc={code} no_space_message={no_space} fail_s={seconds:.1f} "
              f"previous_intact={after == before} visible_partitions={visible(root / 'features')} "
              f"hidden_leftovers={len(leftovers)}")
        assert code != 0
        assert no_space, err[-4000:]
        assert after == before
        assert visible(root / "features") == visible(root / "quarantine") == [f"ds={DS}"]
        assert all(".staging-" in name for name in leftovers), leftovers
        assert json.loads((features_dir / "_MANIFEST.json").read_text())["input"]["raw_rows"] == 2_000
    finally:
        subprocess.run(["umount", "-l", str(mount_dir)], check=False)
        mount_dir.rmdir()


# --- 9: bad raw input ---------------------------------------------------------------------------------------

def write_raw(root: Path, events: pa.Table | None, labels: pa.Table | None = None, ds: str = DS) -> None:
    part = root / "raw" / f"ds={ds}"
    (part / "events").mkdir(parents=True)
    (part / "labels").mkdir()
    if events is not None:
        pq.write_table(events, part / "events" / "part-00000.parquet")
    labels = labels if labels is not None else pa.table(
        {"customer_id": ["C1", "C2", "C3"], "label": pa.array([1, 0, 0], pa.int32())})
    pq.write_table(labels, part / "labels" / "part-00000.parquet")
    (part / "_MANIFEST.json").write_text(json.dumps({"dataset": "raw", "ds": ds}))
    (part / "_SUCCESS").write_text("")


def good_rows(n: int = 3) -> dict[str, list]:
    return {
        "event_id": [f"e{i}" for i in range(n)], "customer_id": ["C1"] * n,
        "event_ts": ["2026-01-05T10:00:00Z"] * n, "event_type": ["purchase"] * n,
        "amount": ["10.0"] * n, "channel": ["web"] * n, "device": ["mobile"] * n, "country": ["DE"] * n,
    }


def run_case(root: Path) -> tuple[int, str, str]:
    return finish(features_job(root), timeout=240)


def test_bad_raw_input_is_quarantined_or_refused_never_silently_wrong(tmp_path):
    outcomes: dict[str, str] = {}

    # Wrong types: numbers and timestamps as native types instead of the raw text.
    typed = good_rows()
    root = tmp_path / "wrong_types"
    write_raw(root, pa.table({**typed, "customer_id": pa.array([1, 1, 2], pa.int64()),
                              "amount": pa.array([10.0, 2.5, 1.0], pa.float64()),
                              "event_ts": pa.array([1767607200] * 3, pa.timestamp("s", tz="UTC"))}))
    code, out, err = run_case(root)
    assert code == 0, err[-3000:]
    qm = manifest(root, "quarantine", DS)
    reasons_seen = ",".join(k for k, v in qm["by_reason"].items() if v)
    outcomes["wrong_types"] = f"quarantined:{qm['row_count']}:{reasons_seen}"
    assert manifest(root, "features", DS)["row_count"] == 0 or qm["row_count"] == 0

    # Missing column: the job fails naming it, and publishes nothing.
    root = tmp_path / "missing_column"
    cols = good_rows()
    del cols["country"]
    write_raw(root, pa.table(cols))
    code, out, err = run_case(root)
    outcomes["missing_column"] = f"rc={code}"
    assert code != 0 and "country" in err, err[-3000:]
    assert not (root / "features").exists() or visible(root / "features") == []

    # Empty partition (a file with the schema and no rows): an empty, published, flagged-by-gate result.
    root = tmp_path / "empty"
    write_raw(root, pa.table({c: pa.array([], pa.string()) for c in RAW_NAMES}))
    code, out, err = run_case(root)
    assert code == 0, err[-3000:]
    fm = manifest(root, "features", DS)
    from hybridflow.exceptions import DataQualityError
    from hybridflow.pipeline import quality
    with pytest.raises(DataQualityError):
        quality.gate(fm, None, quality.load_contract())
    outcomes["empty_rows"] = f"published_rows={fm['row_count']}+gate_fails"

    # Empty partition (no data file at all): refused, nothing published.
    root = tmp_path / "no_files"
    write_raw(root, None)
    code, out, err = run_case(root)
    outcomes["no_files"] = f"rc={code}"
    assert code != 0 and ("UNABLE_TO_INFER_SCHEMA" in err or "Unable to infer schema" in err), err[-3000:]

    # Huge values and non-UTF-8 bytes in every text column the features use.
    root = tmp_path / "huge_and_binary"
    big = {
        "huge-amount-1": (b"C1", b"purchase", b"1e308", b"web"),
        "huge-amount-2": (b"C1", b"purchase", b"1e308", b"web"),
        "huge-customer": (b"C" * 100_000, b"view", None, b"web"),
        "ok-1": (b"C2", b"purchase", b"3.0", b"app"),
        "binary-channel": (b"C3", b"view", None, b"w\xffb"),
        "binary-amount": (b"C3", b"purchase", b"1\xfe", b"web"),
        "binary-type": (b"C3", b"vi\x80w", None, b"web"),
    }
    names = list(big)
    write_raw(root, pa.table({
        "event_id": pa.array([n.encode() for n in names], pa.binary()),
        "customer_id": pa.array([big[n][0] for n in names], pa.binary()),
        "event_ts": pa.array([b"2026-01-05T10:00:00Z"] * len(names), pa.binary()),
        "event_type": pa.array([big[n][1] for n in names], pa.binary()),
        "amount": pa.array([big[n][2] for n in names], pa.binary()),
        "channel": pa.array([big[n][3] for n in names], pa.binary()),
        "device": pa.array([b"mobile"] * len(names), pa.binary()),
        "country": pa.array([b"DE"] * len(names), pa.binary()),
    }), labels=pa.table({"customer_id": ["C1", "C2", "C3", "C" * 100_000],
                         "label": pa.array([1, 0, 0, 1], pa.int32())}))
    code, out, err = run_case(root)
    assert code == 0, err[-3000:]
    quarantine = read(root, "quarantine", DS)
    reasons = dict(zip((e.decode() for e in quarantine["event_id"].to_pylist()),
                       quarantine["reason"].to_pylist(), strict=True))
    assert {k: v for k, v in reasons.items() if k.startswith("binary-")} == {
        "binary-channel": "invalid_utf8", "binary-amount": "invalid_utf8", "binary-type": "invalid_utf8"}
    features = read(root, "features", DS)
    non_finite = {c: int(pc.sum(pc.invert(pc.is_finite(features[c]))).as_py() or 0) for c in FEATURE_COLUMNS}
    bad = {c: n for c, n in non_finite.items() if n}
    outcomes["huge_and_binary"] = (f"quarantined={len(reasons)} feature_rows={features.num_rows} "
                                   f"non_finite_feature_cells={sum(bad.values())}")
    print("RELIABILITY bad_raw_input " + " ".join(f"{k}={v.replace(' ', ';')}" for k, v in outcomes.items()))
    assert not bad, f"non-finite features (silently wrong): {bad}; quarantine reasons {reasons}"
    assert reasons.get("huge-amount-1") == reasons.get("huge-amount-2") == "bad_amount_type", reasons
    assert "C" * 100_000 in features["customer_id"].to_pylist()
