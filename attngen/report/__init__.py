"""Reports on a spec for people: the tile map the kernels follow, FLOPs and HBM bytes, `attngen explain` (never runs the pipeline itself)."""
