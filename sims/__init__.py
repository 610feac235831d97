"""loradyn command line: click commands over the engine (``dynamics``) and theory (``hermite``)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("loradyn")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

__all__ = ["__version__"]
