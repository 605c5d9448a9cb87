from .decode import resident_programs_for, run

__all__ = ["resident_programs_for", "run"]
