"""attngen's version, stated once: the package, its generated modules' headers and the cache key read it."""

__version__ = "0.1.0"
