"""turnstile: a durable, event-sourced turn engine for LLM chat agents over Apache Kafka.

The repository keeps the design card's folders at its top level (`events/`, `projections/`,
`handlers/`, `streams/`); installed, they are the subpackages `turnstile.events`,
`turnstile.projections`, `turnstile.handlers` and `turnstile.streams` of this one namespace.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("turnstile-engine")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

__all__ = ["__version__"]
