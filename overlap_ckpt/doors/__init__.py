"""Doors: how each training-loop style reaches the engine.

A door knows one framework's train state (where params, optimizer state and the rest live,
how the jitted step is told it is in a window, how its outbox comes back) and nothing of
storage. The manager (:mod:`overlap_ckpt.manager`) is door-agnostic.
"""
