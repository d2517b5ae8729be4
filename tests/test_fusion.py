"""SandboxFusion's POST /run_code on the node's and the gateway's HTTP, called with the real `sandbox-fusion`
client package (as code-RL reward functions call it) and with verl's request shape, on real nodes."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest
import requests
from conftest import no_leftovers
from sandbox_fusion import (
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterRequest,
    SummaryMapping,
    run_code,
    run_jupyter,
    summary_run_code_result,
)

from shoal.cluster.local import LocalCluster

PROJECTS = {"alice": {}, "bob": {}}
MAPPING = SummaryMapping(CompileFailed="compile failed", RunTimeout="timeout", RunFailed="run failed")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path_factory.mktemp("fusion"), nodes=1, projects=PROJECTS, prefix="fu")
    try:
        lc.add_gateway()
        yield lc
    finally:
        lc.stop()
    for node in lc.nodes:
        assert not no_leftovers(node.home, node.cgroup_parent, node_stopped=True)


def _endpoints(lc: LocalCluster, project: str = "bob") -> list[str]:
    """The node's and the gateway's HTTP, with the token where `requests` takes it (basic auth's password)."""
    token = lc.project_tokens[project]
    return [f"http://shoal:{token}@{lc.nodes[0].http}", f"http://shoal:{token}@{lc.gateways[0].http}"]


def _run(endpoint: str, **request: object) -> RunCodeResponse:
    return run_code(RunCodeRequest(**request), endpoint=endpoint, max_attempts=1, client_timeout=120)


def test_languages_through_node_and_gateway(cluster: LocalCluster) -> None:
    for endpoint in _endpoints(cluster):
        py = _run(endpoint, code="import sys; print(sys.stdin.read().upper())", language="python", stdin="abc")
        assert py.status == "Success" and py.message == "" and py.compile_result is None, py
        assert py.run_result.status == "Finished" and py.run_result.return_code == 0
        assert py.run_result.stdout == "ABC\n" and py.run_result.execution_time > 0
        assert summary_run_code_result(py, MAPPING) == "Success"

        cpp = _run(
            endpoint,
            code="#include <iostream>\nint main(){int a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}",
            language="cpp",
            stdin="2 40",
        )
        assert cpp.status == "Success" and cpp.run_result.stdout == "42\n", cpp
        assert cpp.compile_result.status == "Finished" and cpp.compile_result.return_code == 0

        sh = _run(
            endpoint,
            code="cat in.txt; echo $((6*7)) > out.txt; echo oops >&2; exit 3",
            language="bash",
            files={"in.txt": base64.b64encode(b"given\n").decode()},
            fetch_files=["out.txt"],
        )
        assert sh.status == "Failed" and sh.run_result.return_code == 3, sh
        assert sh.run_result.stdout == "given\n" and sh.run_result.stderr == "oops\n"
        assert base64.b64decode(sh.files["out.txt"]) == b"42\n"
        assert summary_run_code_result(sh, MAPPING) == "run failed"


def test_compile_errors_timeouts_and_memory_bombs(cluster: LocalCluster) -> None:
    for endpoint in _endpoints(cluster):
        bad = _run(endpoint, code="int main(){ return x; }", language="cpp")
        assert bad.status == "Failed" and bad.run_result is None, bad
        assert bad.compile_result.status == "Finished" and bad.compile_result.return_code != 0
        assert "x" in bad.compile_result.stderr
        assert summary_run_code_result(bad, MAPPING) == "compile failed"

        slow = _run(endpoint, code="while True: pass", language="python", run_timeout=1)
        assert slow.status == "Failed" and slow.run_result.status == "TimeLimitExceeded", slow
        assert summary_run_code_result(slow, MAPPING) == "timeout"

        # verl's reward helper posts this shape itself (memory_limit_MB is not in the client's model)
        bomb = requests.post(
            f"{endpoint}/run_code",
            json={
                "code": "x = []\nwhile True: x.append(bytearray(1 << 20))",
                "language": "python",
                "stdin": "",
                "compile_timeout": 10,
                "run_timeout": 30,
                "memory_limit_MB": 64,
                "files": {},
                "fetch_files": [],
            },
            timeout=120,
        ).json()
        assert bomb["status"] == "Failed" and bomb["message"] == "memory limit exceeded", bomb
        assert bomb["run_result"]["status"] == "Finished" and bomb["run_result"]["return_code"] != 0


def test_tokens_and_bad_requests(cluster: LocalCluster) -> None:
    for endpoint in _endpoints(cluster):
        plain = "http://" + endpoint.partition("@")[2]
        body = {"code": "print(1)", "language": "python"}
        assert requests.post(f"{plain}/run_code", json=body, timeout=60).status_code == 401
        wrong = requests.post(f"http://shoal:nope@{endpoint.partition('@')[2]}/run_code", json=body, timeout=60)
        assert wrong.status_code == 401 and "unknown token" in wrong.text
        bearer = {"Authorization": f"Bearer {cluster.project_tokens['alice']}"}
        ok = requests.post(f"{plain}/run_code", json=body, headers=bearer, timeout=60).json()
        assert ok["status"] == "Success" and ok["run_result"]["stdout"] == "1\n", ok
        admin = {"Authorization": f"Bearer {cluster.cluster_token}"}
        ok = requests.post(f"{plain}/run_code", json=body, headers=admin, timeout=60).json()
        assert ok["status"] == "Success" and ok["run_result"]["stdout"] == "1\n", ok
        huge = requests.post(f"{endpoint}/run_code", json={**body, "memory_limit_MB": 1 << 20}, timeout=60).json()
        assert huge["status"] == "SandboxError" and "memory_limit_MB" in huge["message"], huge
        go = requests.post(f"{endpoint}/run_code", json={"code": "package main", "language": "go"}, timeout=60)
        assert go.status_code == 200 and go.json()["status"] == "SandboxError" and "'go'" in go.json()["message"]
        with pytest.raises(Exception, match="SandboxError|not supported"):
            _run(endpoint, code="x", language="rust")


def test_run_jupyter_cells_share_a_namespace(cluster: LocalCluster) -> None:
    """The sandbox-fusion client's run_jupyter: cells run in order in one namespace, each with its own
    stdout, stderr, display (the last expression) and error; a cell that raises or overruns cell_timeout
    has its error and the next cells still run; a notebook over total_timeout is a Failed driver."""
    cells = [
        "a = 123",
        "a",
        "print(a)",
        "import sys; sys.stderr.write('stderr message')",
        "raise RuntimeError('error message')",
        "import time; time.sleep(30)",
        "print(open('in.txt').read()); open('out.txt', 'w').write(str(a * 2))",
    ]
    for endpoint in _endpoints(cluster):
        request = RunJupyterRequest(
            cells=cells, cell_timeout=2, total_timeout=60, files={"in.txt": base64.b64encode(b"given").decode()},
            fetch_files=["out.txt"],
        )  # fmt: skip
        notebook = run_jupyter(request, endpoint=endpoint, max_attempts=1, client_timeout=120)
        assert notebook.status == "Success" and len(notebook.cells) == len(cells), notebook
        first, value, printed, err, raised, slow, files = notebook.cells
        assert first.display == [] and first.error == [] and first.stdout == ""
        assert value.display == [{"text/plain": "123"}]
        assert printed.stdout == "123\n" and printed.display == []
        assert err.stderr == "stderr message" and err.display == [{"text/plain": "14"}]
        assert raised.error[0]["ename"] == "RuntimeError" and raised.error[0]["evalue"] == "error message"
        assert slow.error[0]["ename"] == "TimeoutError", slow
        assert files.stdout == "given\n" and files.error == [], files
        assert base64.b64decode(notebook.files["out.txt"]) == b"246"
        over = run_jupyter(
            RunJupyterRequest(cells=["import time; time.sleep(300)"], total_timeout=1),
            endpoint=endpoint, max_attempts=1, client_timeout=120,
        )  # fmt: skip
        assert over.status == "Failed" and over.driver.status == "TimeLimitExceeded" and over.cells == [], over
        rust = requests.post(f"{endpoint}/run_jupyter", json={"cells": ["1"], "kernel": "rust"}, timeout=60).json()
        assert rust["status"] == "SandboxError" and "kernel" in rust["message"], rust
    plain = "http://" + _endpoints(cluster)[0].partition("@")[2]
    assert requests.post(f"{plain}/run_jupyter", json={"cells": ["1"]}, timeout=60).status_code == 401


def test_verl_reward_helper_scores_through_the_gateway(cluster: LocalCluster) -> None:
    """verl's own SandboxFusion reward helper (check_correctness: one /run_code per test case)."""
    from verl.utils.reward_score.sandbox_fusion.utils import check_correctness

    url = _endpoints(cluster)[1] + "/run_code"
    in_outs = {"inputs": ["1 2\n", "20 22\n"], "outputs": ["3\n", "42\n"]}
    right, _ = check_correctness(url, in_outs, "a, b = map(int, input().split())\nprint(a + b)")
    assert right == [True, True], right
    wrong, _ = check_correctness(url, in_outs, "a, b = map(int, input().split())\nprint(a - b)")
    assert wrong == [False, False], wrong
    cpp = '#include <cstdio>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);}'
    assert check_correctness(url, in_outs, cpp, language="cpp")[0] == [True, True]
