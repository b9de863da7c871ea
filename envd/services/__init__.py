"""envd's Connect services: one package per service."""
