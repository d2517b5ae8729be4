"""Shared QEMU machinery for the `microvm` and `vm` substrates (see substrate.py for the layout on disk)."""
