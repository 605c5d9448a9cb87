"""flashdecode: fast GQA KV-cache decode attention, a drop-in for FlashAttention's flash_attn_with_kvcache."""
from .api import Route, flash_attn_with_kvcache, flash_decode_with_kvcache, plan_for
from .context import DecodeContext
from .kernels.base import BackendError
from .validate import set_value_checks

__all__ = ["BackendError", "DecodeContext", "Route", "flash_attn_with_kvcache", "flash_decode_with_kvcache",
           "plan_for", "set_value_checks"]
__version__ = "0.2.0"
