"""flashdecode as a kernels-format package for transformers' continuous batching (``generate_batch``).

Its decode-only batches call ``flash_attn_with_kvcache`` over the paged cache and its block table
(flashdecode's); prefill calls ``flash_attn_varlen_func`` (SDPA over the packed sequences).
Loaded offline by the ``kernels`` library: ``flashdecode.integrations.transformers.paged_kernel()``.
"""
from flashdecode import flash_attn_with_kvcache
from flashdecode.integrations.transformers import varlen_attention as flash_attn_varlen_func

__all__ = ["flash_attn_varlen_func", "flash_attn_with_kvcache"]
