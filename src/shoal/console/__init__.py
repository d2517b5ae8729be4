"""The web console: a farm, a sandbox, a trajectory and a screen, seen in a browser (docs/CONSOLE.md).

Served under /console/ by the node's and the gateway's HTTP port (cluster/http.py mounts it). It knows
nothing of nodes or gateways: its host hands it a `Backend` (backend.py) that checks tokens and calls
operations of the operation table for a viewer, so a project token sees exactly what its TCP connection
would (the node resolves it through cluster/tenancy.py, the gateway through its own routing), and the
cluster token sees everything. The front end is plain ES modules (static/), with xterm.js vendored: nothing
is built and nothing is fetched at run time.
"""

from shoal.console.backend import Backend, Viewer
from shoal.console.routes import PREFIX, mount

__all__ = ["PREFIX", "Backend", "Viewer", "mount"]
