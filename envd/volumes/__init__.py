"""Volumes in the guest: E2B volumes mounted with FUSE, served by the host (wire.py)."""
