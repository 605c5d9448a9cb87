"""flashdecode: fast GQA KV-cache decode attention (drop-in for flash_attn_with_kvcache's decode path)."""
from .api import flash_decode_with_kvcache
from .validate import set_seqlens_check

__all__ = ["flash_decode_with_kvcache", "set_seqlens_check"]
__version__ = "0.1.0"
