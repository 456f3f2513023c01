"""visiontrain: one PyTorch training engine for classification, detection and self-supervised
vision models. ``visiontrain fit RECIPE`` trains; see the README."""

__version__ = "0.1.0"
