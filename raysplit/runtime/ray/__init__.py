"""Ray itself: the backend, the actors, their crew and pool, resources (the only runtime files that import Ray)."""
