"""The TileLang backend (``backend.TileLangBackend``): Hopper kernels built with TileLang on first use.

Modules by concern: ``config`` (tile configs, the compiled-for shape), ``occupancy`` (shared memory,
registers, residency), ``macros`` and ``kernels`` (the prim_funcs), ``patches`` (the rewrite of
TileLang's generated CUDA), ``build`` (compiling), ``launch`` (the fast call), ``backend``.
Importing this package does not import TileLang.
"""
