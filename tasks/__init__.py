"""Prefect tasks: thin wrappers adding cache keys, retries and artifacts around pivotrl calls."""
