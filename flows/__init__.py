"""Prefect flows composing pivotrl tasks, and the command-line interface."""
