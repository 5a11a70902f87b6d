"""Run inside a testbed seat (``enter.py SEATS testbed_probe PORT``): report what the kernel gives this rank.

Prints one JSON line: the seat as verified against /proc, the CPU time this process got over a
second of busy wall time, and (rank 0) how long sending SEND_BYTES to rank 1's node took.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from tessera.testbed.seat import current_seat, verify_seat

SEND_BYTES = 2 << 20


def cpu_share(seconds: float = 1.0) -> float:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall0 < seconds:
        sum(range(1000))
    return (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def main() -> None:
    seat, port = current_seat(), int(sys.argv[1])
    out = {"rank": seat.rank, "verified": verify_seat(seat), "cpu_share": cpu_share()}
    if seat.rank == 1:  # receive on this node's home address
        with socket.create_server((seat.address, port)) as server:
            conn, _ = server.accept()
            got = 0
            while chunk := conn.recv(1 << 16):
                got += len(chunk)
            out["received"] = got
            conn.close()
    else:
        peer = os.environ["PROBE_PEER"]
        deadline = time.monotonic() + 90  # the peer imports torch (via tessera) on 0.15 of a core first
        while True:
            try:
                conn = socket.create_connection((peer, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        start = time.perf_counter()
        conn.sendall(b"x" * SEND_BYTES)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # the peer closes once it has read everything
        out["send_s"] = time.perf_counter() - start
        conn.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
