"""The package version, at the bottom layer so any module can report it (the root package
re-exports it as ``resilient_ckpt.__version__``)."""

__version__ = "0.1.0"
