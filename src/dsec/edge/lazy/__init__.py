"""A node's lazy image layers (issue 17): remote layers as FUSE files whose reads fetch 256
KiB chunks from the blob store (see layers.py)."""
