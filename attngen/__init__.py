"""attngen: compile attention variants written in a small language into fused Triton kernels."""
