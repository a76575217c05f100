"""Code every service uses: formats, QoQ math, the reference model, registry, storage, stubs."""

__version__ = "0.1.0"
