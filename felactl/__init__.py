"""felactl: train PyTorch models on clusters whose devices and links are not alike."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazily, so that `import felactl.optimizer` (pure, no torch) does not import torch.
    if name == "TrainJob":
        from felactl.job import TrainJob

        return TrainJob
    raise AttributeError(f"module 'felactl' has no attribute {name!r}")
