"""Triton: the bundled tritonserver of nvidia-pytriton, behind its guard (jobs/tritonguard)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .common import (
    REPO,
    SERVING_VENV,
    STACK,
    P,
    Service,
    http_ok,
    run,
    spawn,
)


def pytriton_dir() -> Path:
    found = sorted((SERVING_VENV / "lib").glob("python3*/site-packages/pytriton"))
    if not found:
        raise RuntimeError(f"nvidia-pytriton is not installed in {SERVING_VENV}; run `make venv` first")
    return found[0]


def triton_backend_dir() -> Path:
    """The python backend assembled from the wheel's parts, with the stub for the serving interpreter."""
    bundle = pytriton_dir() / "tritonserver"
    minor = run([str(SERVING_VENV / "bin/python"), "-c",
                 "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"]).stdout.strip()
    backend = P.triton / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for src in (bundle / "backends/python/libtriton_python.so",
                bundle / "backends/python/triton_python_backend_utils.py",
                bundle / f"python_backend_stubs/{minor}/triton_python_backend_stub"):
        dst = backend / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size:
            shutil.copy2(src, dst)
    return backend.parent


def triton_env() -> dict:
    libdir = run([str(SERVING_VENV / "bin/python"), "-c",
                  "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"]).stdout.strip()
    libs = pytriton_dir().parent / "nvidia_pytriton.libs"
    # The stub must load the serving interpreter's own libpython (not Debian's) and find its numpy via PATH.
    return dict(os.environ, LD_LIBRARY_PATH=f"{libs}:{libdir}", PATH=f"{SERVING_VENV / 'bin'}:{os.environ['PATH']}")


def triton_ready() -> bool:
    return http_ok(f"http://127.0.0.1:{STACK['triton_http_port']}/v2/health/ready")


def triton_upstream_port() -> int:
    return int(STACK.get("triton_upstream_http_port", STACK["triton_http_port"] + 10))


def triton_upstream_grpc_port() -> int:
    return int(STACK.get("triton_upstream_grpc_port", STACK["triton_grpc_port"] + 10))


def start_triton() -> int:
    """The guard (jobs/tritonguard) on Triton's public HTTP and gRPC ports, supervising tritonserver on loopback
    ports of its own: a hostile infer request gets a 4xx (INVALID_ARGUMENT) from the guard, requests without a
    version follow the model's release, and a dead server is started again."""
    backends = triton_backend_dir()
    binary = pytriton_dir() / "tritonserver/bin/tritonserver"
    upstream = triton_upstream_port()
    server = [
        str(binary), f"--model-repository={P.storage / 'model-repository'}", "--model-control-mode=explicit",
        "--http-address=127.0.0.1", f"--http-port={upstream}",
        "--grpc-address=127.0.0.1", f"--grpc-port={triton_upstream_grpc_port()}",
        "--metrics-address=127.0.0.1", f"--metrics-port={STACK['triton_metrics_port']}",
        f"--backend-directory={backends}", "--exit-timeout-secs=10", "--log-verbose=0",
        # A deploy whose model fails to load must not mark the whole server unready (and pull the versions
        # that still serve out of a load balancer): readiness is judged per model by the deploy operator.
        "--strict-readiness=false",
        # A restart serves again what each model's config.pbtxt version policy names (explicit mode starts empty
        # otherwise); one model failing to load there must not keep the server, and every other model, down.
        "--load-model=*", "--exit-on-error=false",
        f"--backend-config=python,shm-region-prefix-name=hybridflow{STACK['triton_http_port']}",
    ]
    guard = [str(SERVING_VENV / "bin/python"), "-m", "tritonguard",
             f"--listen=127.0.0.1:{STACK['triton_http_port']}", f"--upstream=http://127.0.0.1:{upstream}",
             f"--grpc-listen=127.0.0.1:{STACK['triton_grpc_port']}",
             f"--grpc-upstream=127.0.0.1:{triton_upstream_grpc_port()}",
             f"--admin-listen=127.0.0.1:{STACK['triton_guard_admin_port']}",
             f"--state-file={P.triton / 'releases.json'}"]
    env = dict(triton_env(), PYTHONPATH=str(REPO / "jobs"))
    return spawn([*guard, "--", *server], P.logs / "triton.log", env=env)


# Triton as started before the guard: tritonserver itself on the public port, its pid in triton.pid.
UNGUARDED_TRITON = Service("triton", lambda: False, lambda: None, comm="tritonserver")


def services() -> list[Service]:
    return [Service("triton", triton_ready, start_triton, comm="python",
                    endpoint=f"http://127.0.0.1:{STACK['triton_http_port']}", logfile=P.logs / "triton.log")]
