"""specc's version (written into bundles and Triton repositories)."""
__version__ = "0.1.0"
