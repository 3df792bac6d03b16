"""Tooling around the library: the ``overlap-ckpt`` command, the demo, planning, demo models."""
