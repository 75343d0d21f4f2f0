"""What runs in a client actor: the client host and its components (raysplit/runtime/__init__.py)."""
