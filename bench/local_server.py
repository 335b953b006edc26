"""A server for a benchmark: spawned in its own process on a free loopback port, as serve.py
would run, and waited for until it answers /health."""

import multiprocessing
import socket
import time

import httpx


def start_server(target, *args, timeout: float = 120.0):
    """Run `target(port, *args)` in a spawned process; (the process, its base URL) once its
    /health answers. Exits naming the failure if it does not start within `timeout`."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = multiprocessing.get_context("spawn").Process(target=target, args=(port, *args),
                                                           daemon=True)
    process.start()
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while True:
        try:
            httpx.get(f"{url}/health").raise_for_status()
            return process, url
        except httpx.TransportError:
            if time.monotonic() > deadline or not process.is_alive():
                raise SystemExit("the server did not start") from None
            time.sleep(0.2)
