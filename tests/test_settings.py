"""Every SHOAL_* variable is declared once in shoal.settings, read only through it, and documented in
docs/SETTINGS.md (generated). Fast: no node, no root."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shoal import settings
from shoal.config import NodeSettings, Paths

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "shoal"
NAME = re.compile(r"SHOAL_[A-Z0-9_]+")  # a name ending in _ is a prefix (SHOAL_TEST_), not a variable
# A direct read of the environment for a SHOAL_ variable, anywhere but shoal/settings.py.
DIRECT_READ = re.compile(
    r"(environ\.get|getenv|environ\.pop)\(\s*f?[\"']SHOAL_"  # os.environ.get("SHOAL_X"), os.getenv(...)
    r"|environ\[\s*f?[\"']SHOAL_\w*[\"']\s*\](?!\s*=[^=])"  # os.environ["SHOAL_X"] (not an assignment)
    r"|[\"']SHOAL_\w+[\"']\s+in\s+os\.environ"
)
# worker.py runs inside the sandbox as a standalone script (sent as source), where shoal is not importable.
READS_ALLOWED = {SRC / "substrates" / "function" / "worker.py": {"SHOAL_FN_PATH"}}


def _sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p.name != "settings.py")


def test_docs_are_generated_from_the_registry() -> None:
    doc = (ROOT / "docs" / "SETTINGS.md").read_text()
    assert doc == settings.markdown(), "docs/SETTINGS.md is stale: python -m shoal.settings > docs/SETTINGS.md"


def test_every_shoal_name_in_sources_and_docs_is_declared() -> None:
    unknown: dict[str, list[str]] = {}
    files = [*_sources(), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    files += [p for p in (ROOT / "tests").glob("*.py") if p.name != "test_settings.py"]  # this file names examples
    files += [*(ROOT / "bench").glob("*.py"), *(ROOT / "examples").rglob("*.py")]
    for path in files:
        for name in set(NAME.findall(path.read_text())):
            if not name.endswith("_") and name not in settings.REGISTRY:
                unknown.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unknown, f"declare these in src/shoal/settings.py: {unknown}"


def test_no_module_reads_a_shoal_variable_itself() -> None:
    direct = []
    for path in _sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if DIRECT_READ.search(line) and not set(NAME.findall(line)) <= READS_ALLOWED.get(path, set()):
                direct.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not direct, "read these through shoal.settings:\n" + "\n".join(direct)


def test_values_are_typed_and_defaults_apply() -> None:
    env = {"SHOAL_MAX_SANDBOXES": "7", "SHOAL_VM_TEMPLATES": "0", "SHOAL_LOG_RETENTION_S": "2.5", "SHOAL_USERNS": ""}
    assert settings.MAX_SANDBOXES.get(env) == 7
    assert settings.VM_TEMPLATES.get(env) is False
    assert settings.VM_TEMPLATES.get({}) is True
    assert settings.LOG_RETENTION_S.get(env) == 2.5
    assert settings.USERNS.get(env) is None  # empty counts as unset
    assert settings.get("SHOAL_VM_MACHINE", {"SHOAL_VM_MACHINE": "microvm"}) == "microvm"


def test_a_bad_value_names_the_variable_and_the_remedy() -> None:
    with pytest.raises(ValueError, match=r"SHOAL_MAX_SANDBOXES='lots' is not a valid integer.*unset it"):
        settings.MAX_SANDBOXES.get({"SHOAL_MAX_SANDBOXES": "lots"})
    with pytest.raises(ValueError, match="SHOAL_EROFS='maybe' is not a valid 0 or 1"):
        settings.EROFS.get({"SHOAL_EROFS": "maybe"})


def test_node_settings_and_paths_come_from_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_HOME", "/tmp/shoal-settings-test")
    monkeypatch.delenv("SHOAL_IMAGES", raising=False)
    monkeypatch.setenv("SHOAL_POOLS", "debian=2,function:busybox=1")
    monkeypatch.setenv("SHOAL_NODE_ID", "n7")
    assert Paths.from_env().images == Path("/tmp/shoal-settings-test/store")
    node = NodeSettings.from_env(Path("/tmp/shoal-settings-test"))
    assert node.pool_sizes == {"debian": 2, "function:busybox": 1} and node.node_id == "n7"
    assert node.cgroup_parent.startswith("shoal-")  # derived from the home, not the default node's
