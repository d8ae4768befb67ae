"""The version of verispec (a module of its own, so that any module can name it without importing the package)."""

__version__ = "0.1.0"
