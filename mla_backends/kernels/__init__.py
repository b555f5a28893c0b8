"""Our Triton kernels. Import triton only through these modules (lazily, from backends)."""
