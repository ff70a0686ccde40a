"""specc: a compiler for speculative decoding.

    import specc
    model = specc.load("bundles/quickstart")
    print(model.generate(["def fib(n):"], max_new_tokens=32)[0].text)
"""
from .version import __version__


def load(path, verify: bool = True, expect_id: str | None = None, trust_code: bool = False):
    """Open a compiled bundle and return a SpecModel.

    verify: check every file's sha256 (sizes and the file listing are always checked);
    expect_id: refuse a bundle whose id (`specc inspect`) differs; trust_code: allow backends
    that run code from the bundle (aoti, torch_tensorrt). docs/security.md explains each."""
    from .runtime.model import load as _load

    return _load(path, verify=verify, expect_id=expect_id, trust_code=trust_code)


__all__ = ["__version__", "load"]
