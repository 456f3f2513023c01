"""Datasets. Classification: ``build_classification_data(name, ClassificationReader(...)) -> ClassificationData``."""

from visiontrain.data.datasets.classification import (DATASETS, ClassificationData, build_classification_data,
                                                      check_image_files, classification_eval_transform)
from visiontrain.data.datasets.sources import ClassificationReader

__all__ = ["DATASETS", "ClassificationData", "ClassificationReader", "build_classification_data", "check_image_files",
           "classification_eval_transform"]
