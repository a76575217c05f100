"""Alembic migrations of the registry (a package so that they install with it)."""
