"""A small service guarded by route-guards: the example project."""
