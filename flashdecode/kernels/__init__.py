"""Kernel backends. Each exposes ``run(plan, problem, q, k_cache, v_cache, seqlens, out, lse, workspace)``."""
