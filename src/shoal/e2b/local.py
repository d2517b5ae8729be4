"""`shoal e2b serve` as a child process (tests, benchmarks): started on a free port, stopped by `stop()`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from shoal.errors import NodeError


class LocalE2B:
    def __init__(self, target: str | None, workdir: Path, name: str = "e2b", handoff: Path | None = None) -> None:
        """`handoff`: a node's e2b.handoff socket: the server hands its port to that node (server.handoff)."""
        addr_file = workdir / f"{name}.addr"
        addr_file.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "shoal.e2b", "--listen", "127.0.0.1:0", "--addr-file", str(addr_file)]
        if target:
            argv += ["--target", target]
        if handoff:
            argv += ["--handoff", str(handoff)]
        self.log_path = workdir / f"{name}.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not addr_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise NodeError(f"the E2B server did not start; see {self.log_path}")
            time.sleep(0.02)
        self.url = "http://" + addr_file.read_text().strip()

    def env(self, api_key: str) -> dict[str, str]:
        """The SDK's own settings that point an unmodified E2B program at this server."""
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": api_key}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()
