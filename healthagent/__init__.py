"""healthagent: GPU, EFA and InfiniBand/RoCE health agent for Kubernetes training clusters."""

__version__ = "0.1.0"
