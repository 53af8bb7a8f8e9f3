"""The portable family: FlashAttention-2-style Triton kernels for any CUDA GPU and Triton's interpreter."""
