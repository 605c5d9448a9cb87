"""``flashdecode profile``: why one case runs as fast as it does, in six dimensions.

Modules: ``shape`` (the case or flag-given shape), ``geometry`` (grid, waves and tail from the plan:
no device needed), ``ncu`` (Nsight Compute counters: command, CSV parser, per-kernel figures),
``target`` (the program ncu profiles), ``timeline`` (torch.profiler trace of one call),
``catalogue`` (dimensions and diagnosis patterns, as data), ``report`` (report.json/report.md)
and ``command`` (the CLI subcommand). Nothing here imports Triton until a device is measured.
"""
