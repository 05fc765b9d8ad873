"""Exceptions. One base class; the docstring of each class is its default message."""

from __future__ import annotations


class SendonceError(Exception):
    """Something went wrong in sendonce."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(SendonceError):
    """The configuration is incomplete or invalid."""


class DatabaseUnavailable(SendonceError):
    """PostgreSQL cannot be reached right now; retry later."""


class MigrationError(SendonceError):
    """The database schema could not be brought up to date."""


class NotFound(SendonceError):
    """No such object in this account."""


class Conflict(SendonceError):
    """The object is not in a state that allows this operation."""


class InvalidInput(SendonceError):
    """The input is not valid."""


class TransportConfigError(ConfigurationError):
    """The transport URL is not valid."""
