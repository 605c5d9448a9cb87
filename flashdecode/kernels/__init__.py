"""Kernel backends. Each exposes ``run(plan, problem, q, k_cache, v_cache, seqlens, out, lse, part_o,
part_lse, softmax_scale)`` and ``resident_programs_for(problem, profile)``, how many of its split
programs one multiprocessor holds at once (the planner sizes a single sequence's grid by it)."""
