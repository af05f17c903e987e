"""Exception tree of pivotrl.

Catch the narrowest class you can act on::

    PivotRLError
    ├── ConfigError            invalid run configuration (names the key, the value and the rule)
    ├── DataError              invalid demonstration data (names the source, record and field)
    │   └── StateTooLongError  a rendered state exceeds the model's context (skipped and counted)
    ├── ActionParseError       model output that is not a valid action (a reward of 0, not a fault)
    ├── ToolExecutionError     a tool call could not be executed (crash, timeout, resource limit)
    ├── VerifierError          a verifier could not decide (crash or timeout); never a reward of 0
    ├── StorageError           an artifact could not be read or written
    │   ├── StorageAccessError the store refuses us: no credentials, permission denied, no such
    │   │                      bucket (a retry cannot help)
    │   └── SourceNotFoundError a demonstration source file does not exist (also a DataError:
    │                          never retried)
    ├── ModelError             a model source cannot be resolved or a checkpoint is unreadable
    ├── TrainingError          a training invariant failed (non-finite loss, refresh mismatch)
    └── TrackingError          an experiment tracker could not record a run (the run goes on)
"""

from __future__ import annotations


class PivotRLError(Exception):
    """Base class of every error raised on purpose by pivotrl."""


class ConfigError(PivotRLError, ValueError):
    """Invalid run configuration; the message names the key, the value and the rule."""


class DataError(PivotRLError, ValueError):
    """Invalid demonstration data; the message names the source, the record and the field."""


class StateTooLongError(DataError):
    """A rendered turn state is longer than the model's context window."""


class ActionParseError(PivotRLError, ValueError):
    """Model output that does not follow the action format (see ``pivotrl.format.actions``)."""


class ToolExecutionError(PivotRLError, RuntimeError):
    """A tool call could not be executed: the sandbox crashed, timed out or hit a limit."""


class VerifierError(PivotRLError, RuntimeError):
    """A verifier could not reach a decision. Never to be read as a reward of 0."""


class StorageError(PivotRLError, OSError):
    """An artifact could not be read from or written to the run root."""


class StorageAccessError(StorageError):
    """The store cannot be used at all: credentials missing or refused, permission denied, the
    bucket does not exist. Never retried; the message names what to set."""


class SourceNotFoundError(StorageError, DataError):
    """A demonstration source the config names does not exist. A data error (never retried: it
    would fail the same way again) as well as a storage error (for callers that catch those)."""


class ModelError(PivotRLError, RuntimeError):
    """A model source cannot be resolved, or a checkpoint is missing or truncated."""


class TrainingError(PivotRLError, RuntimeError):
    """A training invariant failed: non-finite loss, refresh mismatch, inconsistent ranks."""


class TrackingError(PivotRLError, RuntimeError):
    """An experiment tracker (e.g. an MLflow server) could not record a run; names the URI and call."""
