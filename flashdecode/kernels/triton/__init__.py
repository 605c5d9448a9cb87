"""The Triton backend (``backend.TritonBackend``): split + combine kernels, run on CUDA devices or
under Triton's interpreter."""
