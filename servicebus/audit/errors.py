"""The audit's one exception, shared by every module that can reject its input."""


class AuditError(Exception):
    """Bad input (no journals, bad arguments, no Java): one clear line for the operator."""
