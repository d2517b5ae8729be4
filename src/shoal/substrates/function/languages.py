"""`run_code` languages: the source file each writes, how it is compiled (if at all) and run, in /work."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from shoal.protocol import ExecResult


@dataclass(frozen=True)
class Language:
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    forked: bool = False  # python: run in a fork of the warm worker's interpreter (as `run`, without its start)


LANGUAGES: dict[str, Language] = {
    "python": Language("main.py", ("python3", "main.py"), forked=True),
    "bash": Language("main.sh", ("bash", "main.sh")),
    "c": Language("main.c", ("./main",), ("gcc", "-O2", "-std=gnu17", "-o", "main", "main.c", "-lm")),
    "c++": Language("main.cpp", ("./main",), ("g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp")),
}
LANGUAGES["cpp"] = LANGUAGES["c++"]
LANGUAGES["python3"] = LANGUAGES["python"]
LANGUAGES["sh"] = LANGUAGES["bash"]


def run_code_steps(
    language: str, stdin: bytes | None, compile_timeout: float | None, run_timeout: float | None, cap: int
) -> tuple[list[dict[str, Any]], str]:
    """The worker steps (compile, stopping on failure; then run) and the source file name."""
    lang = LANGUAGES[language]
    steps: list[dict[str, Any]] = []
    if lang.compile:
        steps.append({"argv": list(lang.compile), "timeout": compile_timeout, "cap": cap, "stop_on_failure": True})
    stdin_b64 = base64.b64encode(stdin).decode() if stdin else None
    run: dict[str, Any] = {"script": lang.source} if lang.forked else {"argv": list(lang.run)}
    steps.append({**run, "timeout": run_timeout, "cap": cap, "stdin": stdin_b64})
    return steps, lang.source


def status_of(compiled: ExecResult | None, ran: ExecResult | None) -> str:
    """ok | compile_error | compile_timeout | runtime_error | timeout | memory_exceeded."""
    if compiled is not None and (compiled.timed_out or compiled.exit_code != 0):
        return "compile_timeout" if compiled.timed_out else "compile_error"
    if ran is None:
        return "runtime_error"
    if ran.timed_out:
        return "timeout"
    if ran.oom_killed:
        return "memory_exceeded"
    return "ok" if ran.exit_code == 0 else "runtime_error"
