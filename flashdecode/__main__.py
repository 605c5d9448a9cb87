"""``python -m flashdecode ...``: the same command as the ``flashdecode`` console script."""
from .cli import main

raise SystemExit(main())
