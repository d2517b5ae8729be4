"""shoal across machines: tokens and quotas, the gateway (routing, placement, admission), Ray deployment."""
