"""The benchmark behind ``flashdecode bench``: timing, peers, the run over a case matrix, reports.

Modules: ``timing`` (the one timing helper, shared with the profiler), ``ceiling`` (the in-run
bandwidth ceiling), ``peers`` (other decode implementations), ``provenance`` (what ran where),
``runner`` (the run itself), ``correctness`` (the per-row check of every output), ``results`` (the
data it produces), ``report`` (table, machine lines, JSON, CSV, plot, jsonl record) and
``candidates`` (the candidates log: techniques ranked per case, stagnation). Importing ``ceiling`` or ``runner`` imports Triton, so on a
machine without CUDA set ``TRITON_INTERPRET=1`` first (the CLI does).
"""


class BenchError(Exception):
    """A request the benchmark cannot honour (unknown case, a backend or peer that cannot run here).

    The CLI prints the message and exits non-zero."""


class Unsupported(Exception):
    """A system cannot take one call (a variant or shape it lacks): its result is skipped, with the
    message as the reason, and the run goes on."""
