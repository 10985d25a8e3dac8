"""PyTorch image-training template configured with Hydra, built to make the input pipeline visible."""

__version__ = "0.1.0"
