"""lmgeo library: pure, importable, typed; no argv, no ray.init, no data/ paths."""
