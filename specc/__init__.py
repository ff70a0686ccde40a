"""specc: a compiler for speculative decoding.

    import specc
    model = specc.load("bundles/quickstart")
    print(model.generate(["def fib(n):"], max_new_tokens=32)[0].text)
"""
from .version import __version__


def load(path, verify: bool = True):
    """Open a compiled bundle (verifying file hashes) and return a SpecModel."""
    from .runtime.model import load as _load

    return _load(path, verify=verify)


__all__ = ["__version__", "load"]
