"""felactl: train PyTorch models on clusters whose devices and links are not alike."""

__version__ = "0.1.0"
