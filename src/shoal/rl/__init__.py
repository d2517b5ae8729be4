"""Adapters from the RL stacks teams already run to shoal sandboxes (docs/RL.md).

Each adapter is a client of the public SDK only (`shoal.AsyncClient`), so it works the same against a local
node or a cluster. Import the one you need; each imports its framework, which is an optional extra:

- `shoal.rl.gym`     Gymnasium `ShoalEnv` and `ShoalVectorEnv`          (`pip install shoal[gym]`)
- `shoal.rl.verl`    verl `ShoalTool` (a `BaseTool`) and `code_reward`   (`pip install shoal[verl]`)
- `shoal.rl.skyrl`   skyrl-gym `ShoalTextEnv`, registered as "shoal"     (`pip install shoal[skyrl]`)
- `shoal.rl.swerex`  SWE-ReX `ShoalDeployment` and `ShoalRuntime`        (`pip install shoal[swerex]`)

`shoal.rl.episode` holds what they share: an episode bound to a trajectory name, so a rollout process that is
killed and started again fast-forwards through the steps it already ran instead of running them twice.
"""
