"""Checkpoint blobs: a local folder (default) or any fsspec URL, and signed download URLs."""

from ember.storage.blobs import Storage
from ember.storage.signing import sign_token, verify_token

__all__ = ["Storage", "sign_token", "verify_token"]
