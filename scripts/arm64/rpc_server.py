"""A TVM RPC server for the emulated arm64 Python: `qwc tune --target arm-yitian` measures on it.

    $QWC_ARM64_PY scripts/arm64/rpc_server.py --tracker HOST:PORT --key KEY [--host H] [--port P]

`python -m tvm.exec.rpc_server` starts its server in a child process by exec'ing
`sys.executable`, which here is an aarch64 binary the host kernel cannot exec (qemu-user runs it
only when asked). The server's own state class runs the same listen loop in a thread of this
process; sessions still fork (fork needs no exec), so each measurement runs isolated as usual.
"""

from __future__ import annotations

import argparse
import logging

from tvm.rpc.server import PopenRPCServerState


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tracker", required=True, help="HOST:PORT of the RPC tracker")
    ap.add_argument("--key", required=True, help="the key this device registers under")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9090)
    ap.add_argument("--port-end", type=int, default=9199)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    host, port = a.tracker.rsplit(":", 1)
    state = PopenRPCServerState(a.host, a.port, a.port_end, tracker_addr=(host, int(port)), key=a.key)
    print(f"rpc server on {a.host}:{state.port}, key {a.key}, tracker {a.tracker}", flush=True)
    state.thread.join()


if __name__ == "__main__":
    main()
