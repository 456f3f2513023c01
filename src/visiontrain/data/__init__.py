"""Data: datasets (``visiontrain.data.datasets``) and samplers."""
