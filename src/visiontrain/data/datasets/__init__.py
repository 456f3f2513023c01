"""Datasets. Classification: ``build_classification_data(name, ...) -> ClassificationData``."""

from visiontrain.data.datasets.classification import (DATASETS, ClassificationData, build_classification_data,
                                                      check_image_files, classification_eval_transform)

__all__ = ["DATASETS", "ClassificationData", "build_classification_data", "check_image_files",
           "classification_eval_transform"]
