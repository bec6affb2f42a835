"""gpuslice: GPU sharing for Kubernetes with hard isolation (webhook, extender, node agent)."""

__version__ = "0.1.0"
