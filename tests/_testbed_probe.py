"""Measurements run inside testbed nodes (``felactl testbed exec NODE -- python tests/_testbed_probe.py ...``).

- ``tcp-recv ADDR PORT``: accept one connection, print ``{"bytes", "seconds"}`` of what arrived (timed
  from the first byte to the last, so connection set-up and slow start's first round are not counted).
- ``tcp-send ADDR PORT SECONDS``: send as fast as the link lets for SECONDS.
- ``udp-recv ADDR PORT`` / ``udp-send ADDR PORT COUNT``: datagrams received of COUNT sent.
- ``rtt ADDR PORT COUNT``: with ``echo ADDR PORT`` on the other node, the median TCP round trip of a byte.
- ``busy SECONDS``: spin; print the CPU seconds this process got per wall second.
"""

import json
import socket
import statistics
import sys
import time


def main(mode: str, *args: str) -> None:
    if mode == "tcp-recv":
        srv = socket.create_server((args[0], int(args[1])))
        print("ready", flush=True)
        conn, _ = srv.accept()
        total, first, last = 0, None, None
        while True:
            data = conn.recv(1 << 20)
            if not data:
                break
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                total += len(data)
            last = now
        print(json.dumps({"bytes": total, "seconds": (last - first) if first else 0.0}), flush=True)
    elif mode == "tcp-send":
        sock = socket.create_connection((args[0], int(args[1])), timeout=30)
        buf = b"\0" * (1 << 18)
        end = time.perf_counter() + float(args[2])
        while time.perf_counter() < end:
            sock.sendall(buf)
        sock.close()
    elif mode == "udp-recv":
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((args[0], int(args[1])))
        sock.settimeout(1.0)
        print("ready", flush=True)
        count = 0
        try:
            while True:
                sock.recv(2048)
                count += 1
        except TimeoutError:
            pass
        print(json.dumps({"received": count}), flush=True)
    elif mode == "udp-send":
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(int(args[2])):
            sock.sendto(b"x" * 64, (args[0], int(args[1])))
            time.sleep(0.0001)
    elif mode == "echo":
        srv = socket.create_server((args[0], int(args[1])))
        print("ready", flush=True)
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(1):
            conn.sendall(data)
    elif mode == "rtt":
        sock = socket.create_connection((args[0], int(args[1])), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(int(args[2])):
            t0 = time.perf_counter()
            sock.sendall(b"x")
            sock.recv(1)
            times.append(time.perf_counter() - t0)
        print(json.dumps({"rtt_s": statistics.median(times)}), flush=True)
    elif mode == "busy":
        seconds = float(args[0])
        t0, c0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            pass
        print(json.dumps({"cpu_fraction": (time.process_time() - c0) / (time.perf_counter() - t0)}), flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(*sys.argv[1:])
