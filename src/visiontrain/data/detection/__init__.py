"""Detection data: readers (COCO JSON, Pascal VOC XML, YOLO txt), transforms, collate, samplers,
and the embedded datasets (fashion-mosaic, neon-trees). See base.py for the sample contract."""
