"""flashdecode as a kernels-format package for transformers' continuous batching (``generate_batch``).

Its decode-only batches call ``flash_attn_with_kvcache`` over the paged cache and its block table
(flashdecode's, with sinks as ``s_aux``; CUDA, models without sliding windows); the other batches
call ``flash_attn_varlen_func`` (SDPA over the packed sequences; float32 PyTorch with softcap or sinks).
Loaded offline by the ``kernels`` library: ``flashdecode.integrations.transformers.paged_kernel()``.
"""
from flashdecode.integrations.transformers import kvcache_attention as flash_attn_with_kvcache
from flashdecode.integrations.transformers import varlen_attention as flash_attn_varlen_func

__all__ = ["flash_attn_varlen_func", "flash_attn_with_kvcache"]
