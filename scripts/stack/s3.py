"""The S3 endpoint: moto's server."""

from __future__ import annotations

from .common import (
    STACK,
    VENV,
    P,
    Service,
    http_ok,
    spawn,
)


def start_s3() -> int:
    # moto's server is the S3-compatible endpoint that runs here (no MinIO binary on PyPI or Debian).
    return spawn([str(VENV / "bin/moto_server"), "-H", "127.0.0.1", "-p", str(STACK["s3_port"])], P.logs / "s3.log")


def s3_ready() -> bool:
    return http_ok(f"http://127.0.0.1:{STACK['s3_port']}/")


def services() -> list[Service]:
    return [Service("s3", s3_ready, start_s3, comm="moto_server", endpoint=f"http://127.0.0.1:{STACK['s3_port']}",
                    logfile=P.logs / "s3.log")]
