"""triton: the deployed model through the local tritonserver vs the same TorchScript file called in-process.

Model: the exported propensity model (jobs/hybridtrain: Standardize + the ``small`` MLP 64-128-64-1 + sigmoid,
64 float32 features in, one probability out), released with TritonDeployOperator (publish, load, smoke test,
latency gate, promote) under a throw-away name, with the serving settings of include/config/pipeline.yaml
(python backend, dynamic batching, instance count). Removed afterwards.

Client: tritonclient on the same 2 cores as the server, binary tensors, the request objects built once:
- bs1: N sequential single-row requests over HTTP and over gRPC: p50/p99 latency and requests/s;
- bs64: sequential 64-row requests over HTTP and gRPC: rows/s;
- aio: the asyncio clients with ``AIO_CONCURRENCY`` requests in flight (the deploy's latency gate's client):
  HTTP bs1 req/s, HTTP and gRPC bs64 rows/s (dynamic batching merges the requests queued meanwhile);
- inprocess: the same model.pt with torch.jit.load, 1 thread (the server's setting), bs1 and bs64.
- http_direct, grpc_direct: the same requests straight to tritonserver's own ports, bypassing the guard
  (jobs/tritonguard) that fronts Triton's public HTTP and gRPC ports: ``guard_overhead_bs1_p50_ms`` and
  ``grpc_guard_overhead_bs1_p50_ms`` are what the guard's checks and hop cost (target <= 0.5 ms each);
- canary: a second version loaded beside, the guard's release at a 10% canary, ``CANARY_REQUESTS`` unversioned
  requests on each protocol: ``canary_split_error_pp`` is how far the candidate's share lands from 10%
  (percentage points, the worse protocol).
Ratios: in-process rows/s over served rows/s at bs64 (how much the network path costs).
Targets (shared/notes/local-triton.md, the bundled binary here): HTTP bs1 p50 <= 0.55 ms, p99 <= 0.73 ms,
HTTP bs64 >= 126k rows/s, gRPC bs64 >= 78k rows/s (gRPC bs1 p99 <= 1.21 ms).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "jobs"))

N_FEATURES = 64
BS1_REQUESTS = 2000
BS64_REQUESTS = 1000
AIO_REQUESTS = 2000
AIO_CONCURRENCY = 4
WARMUP = 200
CANARY_REQUESTS = 2000
CANARY_SHARE = 10


def stack_environment() -> None:
    """The connections `make up` wrote (the benchmark runs outside Airflow, like the tests)."""
    path = Path(os.environ.get("HYBRIDFLOW_STATE_DIR", REPO / ".state")) / "airflow-env.json"
    if "AIRFLOW_CONN_TRITON_DEFAULT" not in os.environ:
        if not path.exists():
            raise SystemExit(f"{path} is missing: run `make up` first")
        for key, value in json.loads(path.read_text()).items():
            os.environ.setdefault(key, value)


def export_model(directory: Path, seed: int = 0) -> Path:
    """An export dir like jobs/hybridtrain/export.py writes, from the real model classes (random weights)."""
    import numpy as np
    import torch
    from hybridtrain.config import ModelSpec
    from hybridtrain.model import ProbabilityModel, Standardize, build_network

    torch.manual_seed(seed)
    network = build_network(N_FEATURES, ModelSpec(hidden_sizes=(128, 64), dropout=0.1, preset="small"))
    rng = np.random.default_rng(0)
    model = ProbabilityModel(Standardize(rng.normal(size=N_FEATURES), rng.uniform(0.5, 2, size=N_FEATURES)), network)
    scripted = torch.jit.script(model.eval())
    directory.mkdir(parents=True)
    scripted.save(str(directory / "model.pt"))
    inputs = rng.normal(size=(16, N_FEATURES)).astype(np.float32)
    with torch.inference_mode():
        outputs = torch.jit.load(str(directory / "model.pt"))(torch.from_numpy(inputs)).numpy()
    (directory / "signature.json").write_text(json.dumps({
        "format": "torchscript", "feature_columns": [f"f{i}" for i in range(N_FEATURES)], "n_features": N_FEATURES,
        "inputs": [{"name": "INPUT__0", "dtype": "float32", "shape": [-1, N_FEATURES]}],
        "outputs": [{"name": "OUTPUT__0", "dtype": "float32", "shape": [-1, 1]}]}))
    (directory / "smoke.json").write_text(json.dumps({
        "input_name": "INPUT__0", "output_name": "OUTPUT__0", "atol": 1e-5, "inputs": inputs.tolist(),
        "outputs": outputs.tolist()}))
    return directory


class TaskInstanceStub:
    def xcom_push(self, key, value) -> None:
        pass


def deploy(export_dir: Path, name: str) -> dict:
    from hybridflow.config import load_pipeline_config
    from hybridflow.operators.triton import TritonDeployOperator, deploy_kwargs

    serving = load_pipeline_config().serving
    operator = TritonDeployOperator(task_id="bench", export_dir=str(export_dir),
                                    **{**deploy_kwargs(serving), "model_name": name}, deferrable=False)
    return operator.execute({"ti": TaskInstanceStub()})


def ms(values: list[float], q: float) -> float:
    from hybridflow.utils.latency import percentile

    return round(percentile(values, q) * 1000, 3)


def sequential(call, requests: int) -> tuple[list[float], float]:
    for _ in range(WARMUP):
        call()
    latencies = []
    started = time.perf_counter()
    for _ in range(requests):
        t0 = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - t0)
    return latencies, time.perf_counter() - started


def upstream_url(protocol: str) -> str:
    """tritonserver's own HTTP or gRPC endpoint behind the guard (the local profile's loopback ports)."""
    profile = json.loads(Path(os.environ.get("HYBRIDFLOW_PROFILE", REPO / "include/profiles/local.json")).read_text())
    stack = profile["stack"]
    public = stack[f"triton_{protocol}_port"]
    return f"127.0.0.1:{stack.get(f'triton_upstream_{protocol}_port', public + 10)}"


def canary_split(name: str, hook, export_dir: Path, version: int, batch) -> dict:
    """A second version beside ``version``, a 10% canary on the guard, and where unversioned requests land."""
    from hybridflow.config import ReleaseConfig, load_pipeline_config
    from hybridflow.operators.triton import TritonDeployOperator, serving_kwargs
    from hybridflow.utils.triton import VersionRecord, read_export

    operator = TritonDeployOperator(task_id="bench", export_dir=str(export_dir), release=ReleaseConfig("direct"),
                                    **{**serving_kwargs(load_pipeline_config().serving), "model_name": name})
    bundle = read_export(export_dir)
    candidate = version + 1
    operator.repo.publish_version(name, candidate, bundle.version_files(), VersionRecord(
        version=candidate, sha256=bundle.sha256, n_features=N_FEATURES, source=str(export_dir),
        published_at=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())))
    operator.serve_versions(N_FEATURES, (version, candidate))
    hook.set_release(name, version, candidate, mode="canary", share=CANARY_SHARE)
    figures = {}
    for protocol, url in (("http", hook.http_url), ("grpc", hook.grpc_url)):
        call = served(name, url, protocol, batch, answer=True)
        answered = [call() for _ in range(CANARY_REQUESTS)]
        call.client.close()
        share = 100 * answered.count(str(candidate)) / CANARY_REQUESTS
        figures[f"canary_{protocol}_candidate_share_pct"] = round(share, 2)
    figures["canary_split_error_pp"] = round(max(abs(figures[f"canary_{p}_candidate_share_pct"] - CANARY_SHARE)
                                                 for p in ("http", "grpc")), 2)
    hook.clear_release(name)
    return figures


def served(name: str, url: str, protocol: str, batch, answer: bool = False) -> callable:
    """One prepared request; the call sends it and reads the output (binary tensors on HTTP), or with ``answer``
    returns the version that answered."""
    if protocol in ("http", "http_direct"):
        import tritonclient.http as module

        client = module.InferenceServerClient(url)
        data = module.InferInput("INPUT__0", list(batch.shape), "FP32")
        data.set_data_from_numpy(batch, binary_data=True)
        outputs = [module.InferRequestedOutput("OUTPUT__0", binary_data=True)]
    else:
        import tritonclient.grpc as module

        client = module.InferenceServerClient(url)
        data = module.InferInput("INPUT__0", list(batch.shape), "FP32")
        data.set_data_from_numpy(batch)
        outputs = [module.InferRequestedOutput("OUTPUT__0")]

    def call():
        result = client.infer(name, [data], outputs=outputs)
        if answer:
            response = result.get_response()
            return response["model_version"] if isinstance(response, dict) else response.model_version
        return result.as_numpy("OUTPUT__0")

    call.client = client
    return call


def main() -> dict:
    import numpy as np
    import torch
    from hybridflow.config import load_pipeline_config
    from hybridflow.hooks.model_repository import open_repository
    from hybridflow.hooks.triton import TritonHook

    stack_environment()
    serving = load_pipeline_config().serving
    name = f"bench_triton_{uuid.uuid4().hex[:6]}"
    hook = TritonHook(serving.triton_conn_id)
    figures: dict = {"model": "small MLP 64-128-64-1", "n_features": N_FEATURES, "backend": serving.backend,
                     "instance_count": serving.instance_count, "max_queue_delay_us": serving.max_queue_delay_us,
                     "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2)}
    rng = np.random.default_rng(1)
    bs1 = rng.normal(size=(1, N_FEATURES)).astype(np.float32)
    bs64 = rng.normal(size=(64, N_FEATURES)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        export_dir = export_model(Path(tmp) / "export")
        try:
            report = deploy(export_dir, name)
            figures["deploy"] = {k: report[k] for k in ("version", "promoted", "load_s", "smoke", "latency")}
            print(f"deployed {name} version {report['version']}: load {report['load_s']} s, gate "
                  f"p99 {report['latency']['p99_ms']} ms", flush=True)
            for protocol, url in (("http", hook.http_url), ("http_direct", upstream_url("http")),
                                  ("grpc", hook.grpc_url), ("grpc_direct", upstream_url("grpc"))):
                call = served(name, url, protocol, bs1)
                np.testing.assert_allclose(call(), torch.jit.load(str(export_dir / "model.pt"))(
                    torch.from_numpy(bs1)).detach().numpy(), atol=1e-5)
                latencies, wall = sequential(call, BS1_REQUESTS)
                figures[f"{protocol}_bs1_p50_ms"] = ms(latencies, 50)
                figures[f"{protocol}_bs1_p99_ms"] = ms(latencies, 99)
                figures[f"{protocol}_bs1_req_per_s"] = round(BS1_REQUESTS / wall)
                call.client.close()
                call = served(name, url, protocol, bs64)
                _, wall = sequential(call, BS64_REQUESTS)
                figures[f"{protocol}_bs64_rows_per_s"] = round(BS64_REQUESTS * 64 / wall)
                call.client.close()
                print(f"{protocol}: bs1 p50 {figures[f'{protocol}_bs1_p50_ms']} ms p99 "
                      f"{figures[f'{protocol}_bs1_p99_ms']} ms; bs64 {figures[f'{protocol}_bs64_rows_per_s']} rows/s",
                      flush=True)
            aio = TritonHook(serving.triton_conn_id, protocol="http").measure_latency(
                name, report["version"], bs1.tolist() * 16, concurrency=AIO_CONCURRENCY, requests=AIO_REQUESTS)
            figures["http_aio_bs1_req_per_s"] = aio.throughput_rps
            figures["http_aio_bs1_p99_ms"] = aio.p99_ms
            figures["http_aio_concurrency"] = AIO_CONCURRENCY
            for protocol in ("http", "grpc"):
                aio = TritonHook(serving.triton_conn_id, protocol=protocol).measure_latency(
                    name, report["version"], bs64.tolist(), concurrency=AIO_CONCURRENCY, requests=BS64_REQUESTS,
                    batch_size=64)
                figures[f"{protocol}_aio_bs64_rows_per_s"] = round(aio.throughput_rps * 64)
            figures.update(canary_split(name, hook, export_model(Path(tmp) / "candidate", seed=1),
                                        report["version"], bs1))
            print(f"canary at {CANARY_SHARE}%: HTTP {figures['canary_http_candidate_share_pct']}%, gRPC "
                  f"{figures['canary_grpc_candidate_share_pct']}% to the candidate", flush=True)
        finally:
            hook.unload_model(name)
            hook.close()
            open_repository(serving.repository, serving.storage_conn_id).remove_model(name)

        torch.set_num_threads(1)
        model = torch.jit.load(str(export_dir / "model.pt"), map_location="cpu").eval()
        with torch.inference_mode():
            x1, x64 = torch.from_numpy(bs1), torch.from_numpy(bs64)
            latencies, _ = sequential(lambda: model(x1), BS1_REQUESTS)
            figures["inprocess_bs1_p50_ms"] = ms(latencies, 50)
            figures["inprocess_bs1_p99_ms"] = ms(latencies, 99)
            _, wall = sequential(lambda: model(x64), BS64_REQUESTS * 5)
            figures["inprocess_bs64_rows_per_s"] = round(BS64_REQUESTS * 5 * 64 / wall)
    inprocess = figures["inprocess_bs64_rows_per_s"]
    figures["inprocess_over_http_bs64"] = round(inprocess / figures["http_bs64_rows_per_s"], 1)
    figures["inprocess_over_grpc_bs64"] = round(inprocess / figures["grpc_bs64_rows_per_s"], 1)
    figures["guard_overhead_bs1_p50_ms"] = round(figures["http_bs1_p50_ms"] - figures["http_direct_bs1_p50_ms"], 3)
    figures["grpc_guard_overhead_bs1_p50_ms"] = round(figures["grpc_bs1_p50_ms"] - figures["grpc_direct_bs1_p50_ms"],
                                                      3)
    figures["http_over_inprocess_bs1_p50"] = round(figures["http_bs1_p50_ms"] / figures["inprocess_bs1_p50_ms"], 1)
    keys = ("http_bs1_p50_ms", "http_bs1_p99_ms", "http_direct_bs1_p50_ms", "http_direct_bs64_rows_per_s",
            "guard_overhead_bs1_p50_ms", "grpc_bs1_p50_ms", "grpc_bs1_p99_ms", "grpc_direct_bs1_p50_ms",
            "grpc_guard_overhead_bs1_p50_ms", "canary_split_error_pp", "http_bs64_rows_per_s",
            "grpc_bs64_rows_per_s", "inprocess_bs1_p50_ms", "inprocess_bs64_rows_per_s", "http_aio_bs1_req_per_s",
            "http_aio_bs64_rows_per_s", "grpc_aio_bs64_rows_per_s",
            "inprocess_over_http_bs64", "inprocess_over_grpc_bs64")
    print("figures: " + json.dumps({k: v for k, v in figures.items() if k != "deploy"}), flush=True)
    print("RESULT triton " + " ".join(f"{k}={figures[k]}" for k in keys), flush=True)
    return figures


if __name__ == "__main__":
    main()
