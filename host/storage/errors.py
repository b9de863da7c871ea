"""Exceptions raised by host.storage.

    StorageError
    ├── LayerFormatError        a layer or upper file is truncated, corrupted or not LSMT
    ├── LayerNotFoundError      no layer with that digest locally or in the repository
    ├── StackError
    │   ├── StackNotFoundError
    │   ├── StackExistsError
    │   └── OutOfRangeError     (also ValueError) request past the end of the device
    ├── RepositoryError         a repository backend failed
    │   ├── RepositoryConfigError   (also ValueError) bad or missing backend settings
    │   └── IntegrityError      fetched data does not match its recorded digest (after a refetch)
    └── ControlError            the block server's control API failed or answered an error
"""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every error raised by host.storage."""


class LayerFormatError(StorageError):
    """A layer file does not follow the LSMT format (truncated, bad magic, bad index)."""


class LayerNotFoundError(StorageError, LookupError):
    """No layer with that digest."""


class StackError(StorageError):
    """A stack operation failed."""


class StackNotFoundError(StackError, LookupError):
    """No stack with that name."""


class StackExistsError(StackError):
    """A stack with that name already exists."""


class OutOfRangeError(StackError, ValueError):
    """A read or write reaches past the end of the virtual device."""


class RepositoryError(StorageError):
    """A repository backend failed."""


class RepositoryConfigError(RepositoryError, ValueError):
    """Repository settings are missing or invalid (for example an oss repo without region)."""


class IntegrityError(RepositoryError):
    """Data fetched from the repository (a layer chunk, a file) does not match the digest
    recorded for it, also when fetched a second time; nothing of it was kept or served."""


class ControlError(StorageError):
    """The block server answered a control request with an error it has no class for."""
