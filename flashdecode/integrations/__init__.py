"""Adapters that switch model libraries' attention to flashdecode (each an optional extra):
``transformers`` (``pip install flashdecode[transformers]``)."""
