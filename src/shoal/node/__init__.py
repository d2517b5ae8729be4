"""The node agent: one process per machine that owns the sandboxes there."""
