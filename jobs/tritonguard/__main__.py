"""python -m tritonguard --listen HOST:PORT --upstream URL [--grpc-listen HOST:PORT --grpc-upstream HOST:PORT]
    [--admin-listen HOST:PORT] [--state-file PATH] [limits] [-- tritonserver ARGS...]

With a command after ``--`` the guard also runs that tritonserver and restarts it when it dies (the local stack);
in containers the runtime's restart policy does that and the guard only guards.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from .checks import Limits
from .release import ReleaseBook
from .server import Guard, serve


def parse_listen(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--listen takes HOST:PORT, such as 127.0.0.1:8000; got {value!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    supervise: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, supervise = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="tritonguard", description=__doc__)
    parser.add_argument("--listen", type=parse_listen, required=True)
    parser.add_argument("--upstream", required=True, help="Triton's own HTTP endpoint, e.g. http://127.0.0.1:8010")
    parser.add_argument("--max-request-bytes", type=int, default=128 << 20)
    parser.add_argument("--max-input-bytes", type=int, default=64 << 20)
    parser.add_argument("--upstream-wait-s", type=float, default=30.0)
    parser.add_argument("--admin-listen", type=parse_listen, help="HOST:PORT of /metrics and the release API "
                        "(for the deploy operator and Prometheus only, never clients)")
    parser.add_argument("--state-file", type=Path, help="where releases are kept across restarts")
    parser.add_argument("--grpc-listen", type=parse_listen, help="HOST:PORT of the guarded gRPC front")
    parser.add_argument("--grpc-upstream", help="Triton's own gRPC endpoint, e.g. 127.0.0.1:8011")
    args = parser.parse_args(argv)
    if bool(args.grpc_listen) != bool(args.grpc_upstream):
        parser.error("--grpc-listen and --grpc-upstream go together: the front and the server behind it")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tritonguard %(levelname)s %(message)s")
    guard = Guard(args.upstream.rstrip("/"), Limits(max_input_bytes=args.max_input_bytes),
                  upstream_wait_s=args.upstream_wait_s, releases=ReleaseBook(args.state_file))
    grpc = (*args.grpc_listen, args.grpc_upstream) if args.grpc_listen else None
    asyncio.run(serve(guard, *args.listen, args.max_request_bytes, supervise, admin=args.admin_listen, grpc=grpc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
