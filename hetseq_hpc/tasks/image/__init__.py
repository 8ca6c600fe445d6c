"""Image classification with a small GroupNorm ResNet (``task=image``)."""
