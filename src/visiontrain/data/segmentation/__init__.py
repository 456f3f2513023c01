"""Semantic segmentation data: label maps (one class index a pixel) read from PNG folders and Pascal
VOC's ``SegmentationClass``, or painted from fashion-mosaic's instance masks; their transforms and
collate. See label_maps.py for the sample contract."""
