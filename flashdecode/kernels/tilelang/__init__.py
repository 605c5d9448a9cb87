from .decode import run

__all__ = ["run"]
