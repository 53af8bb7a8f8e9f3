"""The Hopper family: FlashAttention-3-style Gluon kernels for sm_90 (TMA, wgmma, warp specialization)."""
