"""The decode family: split-KV kernels for a few queries over a long key/value cache."""
