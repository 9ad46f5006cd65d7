"""Maintenance commands (``python -m fedsgld.tools.NAME``)."""
