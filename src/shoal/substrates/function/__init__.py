"""The `function` kind's machinery: warm container workers (pool.py), the worker itself (worker.py), per-call
limits (limits.py) and languages for run_code. The node's side of the kind is shoal.node.functions."""
