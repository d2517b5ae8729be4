"""The RL adapters (shoal.rl) driven by the real, pinned frameworks: Gymnasium's own env checker, verl's
BaseTool cycle, skyrl-gym's registry, SWE-ReX's deployment/runtime, mini-swe-agent's DefaultAgent; and a
rollout killed and restarted that resumes by fast-forward (tests/rl_resume_script.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import NodeProcess

import shoal

HERE = Path(__file__).parent
OPTS = {"pool": False, "ttl_s": 300}


# ---------------------------------------------------------------- Gymnasium


def test_gym_env_passes_check_env_and_frees_its_sandbox(node: NodeProcess, client: shoal.Client) -> None:
    from gymnasium.utils.env_checker import check_env

    from shoal.rl.gym import ShoalEnv

    env = ShoalEnv(image="busybox", max_steps=4, client_options={"home": str(node.home)}, **OPTS)
    check_env(env, skip_render_check=True)
    env.close()

    async def reward(episode, result):  # noqa: ANN001, ANN202
        return float((await episode.exec("cat /tmp/n 2>/dev/null || echo 0")).stdout.strip() or 0)

    env = ShoalEnv(
        image="busybox",
        max_steps=3,
        reward_fn=reward,
        setup="echo ready",
        client_options={"home": str(node.home)},
        **OPTS,
    )
    obs, _ = env.reset(seed=1)
    assert obs == {"output": "ready\n", "exit_code": 0}
    first = env.episode.sandbox.id
    obs, r, term, trunc, info = env.step("echo 7 > /tmp/n; echo hi >&2; exit 3")
    assert (obs["exit_code"], r, term, trunc, info["stderr"]) == (3, 7.0, False, False, "hi\n")
    env.step("true")
    *_, trunc, _ = env.step("true")
    assert trunc  # max_steps
    env.reset()
    assert env.episode.sandbox.id != first
    assert first not in {s.id for s in client.list()}
    assert env.step("cat /tmp/n")[0]["exit_code"] == 1  # a fresh sandbox: the last episode's file is gone
    second = env.episode.sandbox.id
    env.close()
    assert second not in {s.id for s in client.list()}


def test_gym_vector_env_steps_sandboxes_concurrently(node: NodeProcess, client: shoal.Client) -> None:
    from shoal.rl.gym import ShoalVectorEnv

    env = ShoalVectorEnv(
        3,
        image="busybox",
        max_steps=2,
        reward_fn=lambda ep, r: float(r.exit_code == 0),
        client_options={"home": str(node.home)},
        **OPTS,
    )
    obs, _ = env.reset(seed=0)
    ids = {ep.sandbox.id for ep in env.episodes}
    assert len(ids) == 3
    start = time.monotonic()
    obs, rewards, term, trunc, infos = env.step(["sleep 1; echo a", "sleep 1; echo b", "exit 1"])
    elapsed = time.monotonic() - start
    assert list(obs["output"]) == ["a\n", "b\n", ""] and list(rewards) == [1.0, 1.0, 0.0]
    assert elapsed < 30  # not a speed claim: only that the three ran in one step call
    *_, trunc, _ = env.step(["true"] * 3)
    assert trunc.all()
    env.step(["true"] * 3)  # next-step autoreset: fresh sandboxes
    assert not ids & {ep.sandbox.id for ep in env.episodes}
    env.close()
    assert not ids & {s.id for s in client.list()}


# ---------------------------------------------------------------- verl


async def test_verl_tool_cycle_in_a_real_sandbox(node: NodeProcess, aclient: shoal.AsyncClient) -> None:
    from verl.tools.base_tool import BaseTool

    from shoal.rl.verl import ShoalTool

    tool = ShoalTool(
        {"image": "busybox", "reward_command": "cat /tmp/score", "client": {"home": str(node.home)}, **OPTS}
    )
    assert isinstance(tool, BaseTool) and tool.name == "shell"
    instance_id, _ = await tool.create()
    sandbox_id = tool.episode(instance_id).sandbox.id
    response, step_reward, metrics = await tool.execute(instance_id, {"command": "echo 0.75 > /tmp/score; echo ok"})
    assert response.text == "ok\n" and metrics["exit_code"] == 0
    response, _, _ = await tool.execute(instance_id, {"command": "ls /nope"})
    assert "[exit code 1]" in response.text
    assert await tool.calc_reward(instance_id) == 0.75
    await tool.release(instance_id)
    assert sandbox_id not in {s.id for s in await aclient.list()}
    with pytest.raises(shoal.SandboxClosedError):
        await aclient.attach(sandbox_id)
    await tool.aclose()


async def test_verl_code_reward_on_the_function_kind(node: NodeProcess, aclient: shoal.AsyncClient) -> None:
    from shoal.rl.verl import code_reward, compute_score

    tests = [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"}, {"input": "1 1\n", "output": "3"}]
    good = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert await code_reward(aclient, good, tests) == pytest.approx(2 / 3)
    assert await code_reward(aclient, "raise SystemExit(1)", tests) == 0.0
    answer = f"Here it is:\n```python\n{good}```"
    assert compute_score("demo", answer, json.dumps(tests[:2]), home=str(node.home)) == 1.0
    assert compute_score("demo", "no code", json.dumps(tests)) == 0.0


# ---------------------------------------------------------------- SkyRL (skyrl-gym)


def test_skyrl_env_registered_and_an_episode_runs(node: NodeProcess, client: shoal.Client) -> None:
    import skyrl_gym

    import shoal.rl.skyrl  # noqa: F401 - registers "shoal"

    assert "shoal" in skyrl_gym.registry
    config = {
        "image": "busybox",
        "max_turns": 3,
        "reward_command": "cat /tmp/r",
        "client": {"home": str(node.home)},
        **OPTS,
    }
    env = skyrl_gym.make("shoal", env_config=config)
    assert isinstance(env, skyrl_gym.Env)
    prompt = [{"role": "user", "content": "write 1 to /tmp/r"}]
    assert env.init(prompt)[0] == prompt
    sandbox_id = env.episode.sandbox.id
    out = env.step("Let me look.<bash>echo hello; ls /nope</bash>")
    assert not out["done"] and out["reward"] == 0.0
    assert (
        out["observations"][0]["content"].startswith("hello\n") and "[exit code 1]" in out["observations"][0]["content"]
    )
    out = env.step("<bash>echo 1 > /tmp/r</bash>")
    out = env.step("<bash>true</bash>")
    assert out["done"] and out["reward"] == 1.0
    env.close()
    assert sandbox_id not in {s.id for s in client.list()}


# ---------------------------------------------------------------- SWE-ReX


async def test_swerex_deployment_sessions_commands_files(node: NodeProcess, aclient: shoal.AsyncClient) -> None:
    from swerex.deployment.abstract import AbstractDeployment
    from swerex.exceptions import NonZeroExitCodeError
    from swerex.runtime.abstract import (
        BashAction,
        CloseBashSessionRequest,
        Command,
        CreateBashSessionRequest,
        ReadFileRequest,
        WriteFileRequest,
    )

    from shoal.rl.swerex import ShoalDeployment

    deployment = ShoalDeployment(image="busybox", client={"home": str(node.home)}, **OPTS)
    assert isinstance(deployment, AbstractDeployment)
    await deployment.start()
    try:
        runtime = deployment.runtime
        assert await deployment.is_alive()
        await runtime.create_session(CreateBashSessionRequest())
        await runtime.run_in_session(BashAction(command="cd /tmp && export X=42"))
        obs = await runtime.run_in_session(BashAction(command="echo $PWD $X"))
        assert (obs.output.strip(), obs.exit_code) == ("/tmp 42", 0)
        with pytest.raises(NonZeroExitCodeError):
            await runtime.run_in_session(BashAction(command="false"))
        assert (await runtime.run_in_session(BashAction(command="false", check="silent"))).exit_code == 1
        await runtime.close_session(CloseBashSessionRequest())
        await runtime.write_file(WriteFileRequest(path="/work/sub/a.txt", content="héllo\n"))
        assert (await runtime.read_file(ReadFileRequest(path="/work/sub/a.txt"))).content == "héllo\n"
        r = await runtime.execute(Command(command="cat /work/sub/a.txt; exit 4", shell=True))
        assert (r.stdout, r.exit_code) == ("héllo\n", 4)
        r = await runtime.execute(Command(command=["echo", "a b"]))
        assert r.stdout == "a b\n"
        sandbox_id = runtime.sandbox.id
    finally:
        await deployment.stop()
    assert sandbox_id not in {s.id for s in await aclient.list()}


# ---------------------------------------------------------------- resume after the rollout process dies


@pytest.mark.parametrize("adapter", ["gym", "verl"])
def test_killed_rollout_resumes_by_fast_forward(node: NodeProcess, client: shoal.Client, adapter: str) -> None:
    name = f"resume-{adapter}-{os.getpid()}"
    argv = [sys.executable, str(HERE / "rl_resume_script.py"), str(node.home), adapter, name]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    kill_after = 4 if adapter == "gym" else 1  # gym: past a whole episode (3 steps + autoreset), into the next
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    try:
        seen = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = first.stdout.readline()
            if not line:
                break
            if not line.startswith(('{"round"', '{"done"')):  # verl's BaseTool prints its schema
                continue
            seen.append(json.loads(line))
            if seen[-1].get("round") == kill_after:
                break
        assert seen and seen[-1].get("round") == kill_after, f"the first run did not get far enough: {seen}"
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait()
    second = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr
    rounds = [json.loads(line) for line in second.stdout.splitlines() if line.startswith(('{"round"', '{"done"'))]
    assert rounds[-1] == {"done": True}
    rounds = rounds[:-1]
    # the same outputs as the first run where they overlap: logged results, not a second run of each command
    for before in seen:
        assert rounds[before["round"]]["outputs"] == before["outputs"]
    if adapter == "gym":  # 3 steps per episode, then an autoreset step whose output is empty
        expected = [["1", "1"], ["2", "2"], ["3", "3"], ["", ""]] * 2
    else:
        expected = [[str(i), str(i)] for i in range(1, 5)]
    assert [r["outputs"] for r in rounds] == expected  # a command run twice would count one line too many
    assert sum(rounds[kill_after]["ff"]) > 0
    leftover = [s for s in client.list() if (s.trajectory or "").startswith(name)]
    assert not leftover


def test_mini_swe_agent_runs_a_scripted_episode_in_a_sandbox(node: NodeProcess, client: shoal.Client) -> None:
    """The real mini-swe-agent: its config names the environment by dotted path, its DefaultAgent runs a
    scripted model (no LLM) whose actions fix a file in the sandbox, time out once, and submit."""
    import yaml
    from minisweagent import package_dir
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel, make_output

    config = yaml.safe_load((package_dir / "config" / "default.yaml").read_text())
    env = get_environment(
        {"environment_class": "shoal.rl.miniswe.ShoalEnvironment", "image": "debian", "cwd": "/work",
         "home": str(node.home), "timeout": 10, "env": {"GREETING": "hi"}, "sandbox": {"labels": {"rl": "mini"}}}
    )  # fmt: skip
    sandbox_id = env.sandbox.id
    try:
        steps = [
            "printf 'def add(a, b):\\n    return a - b\\n' > calc.py && echo $GREETING && pwd",
            "sed -i 's/a - b/a + b/' calc.py && python3 -c 'import calc; print(calc.add(2, 3))'",
            "sleep 60",  # over the action timeout: an observation, not a crash
            "echo oops >&2; exit 3",
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py",
        ]
        outputs = [make_output(f"step {i}\n```mswea_bash_command\n{c}\n```", [{"command": c}]) for i, c in
                   enumerate(steps)]  # fmt: skip
        agent = DefaultAgent(DeterministicModel(outputs=outputs), env, **{**config["agent"], "step_limit": 10})
        result = agent.run("make add() add")
        assert result["exit_status"] == "Submitted", result
        assert result["submission"] == "def add(a, b):\n    return a + b\n"
        observations = [m["content"] for m in agent.messages if m["role"] in ("user", "tool")][1:]
        assert "hi\n/work" in observations[0]
        assert "<returncode>0</returncode>" in observations[1] and "5" in observations[1]
        assert "timed out" in observations[2] and "<returncode>-1</returncode>" in observations[2]
        assert "<returncode>3</returncode>" in observations[3] and "oops" in observations[3]  # stderr merged
        assert client.get(sandbox_id).exec("cat /work/calc.py").stdout.startswith("def add")
        assert env.serialize()["info"]["config"]["sandbox_id"] == sandbox_id
    finally:
        env.cleanup()
    assert sandbox_id not in [s.id for s in client.list()]
