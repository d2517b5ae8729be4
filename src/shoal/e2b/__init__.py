"""E2B compatibility: unmodified `e2b` / `e2b-code-interpreter` programs run on shoal (docs/E2B.md).

`shoal e2b serve` (server.py) answers E2B's REST API (api.py) and the in-sandbox envd API (envd.py, with the
Connect-RPC services generated into the `e2b` package) on one port, as a client of a shoal node or gateway.
"""
