from fedsgld.engine import Federation  # noqa: F401
