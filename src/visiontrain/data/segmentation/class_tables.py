"""The classes of the semantic segmentation datasets read by name, as their own tools list them, so
that a run's class names and metrics line up with every published figure for them.

- Pascal VOC: its devkit's 21 classes, background first (255: the objects' borders).
- Cityscapes: cityscapesscripts' ``helpers/labels.py``: the 19 classes with a ``trainId``, in train-id
  order, and the ``id`` (the value of a ``*_gtFine_labelIds.png``) each comes from; the other ids
  0-33 (unlabeled, ego vehicle, parking, guard rail, caravan, ...) have trainId 255 and are ignored.
- ADE20K (SceneParsing's ADEChallengeData2016): MMSeg's ``ADE20KDataset.METAINFO['classes']``, the
  150 classes of label values 1-150 (0 is "other", no class). MMSeg spells the eighth ``'bed '``;
  it is ``bed`` here.
"""
from __future__ import annotations

VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
               "tvmonitor")

CITYSCAPES_CLASSES = ("road", "sidewalk", "building", "wall", "fence", "pole", "traffic light", "traffic sign",
                      "vegetation", "terrain", "sky", "person", "rider", "car", "truck", "bus", "train", "motorcycle",
                      "bicycle")
#: labels.py's ``id`` of each train class, in train-id order (road is id 7, train id 0).
CITYSCAPES_LABEL_IDS = (7, 8, 11, 12, 13, 17, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 31, 32, 33)
#: The largest ``id`` of labels.py (bicycle); license plate's -1 is 255 in a byte, as is no label.
CITYSCAPES_LAST_ID = 33

ADE20K_CLASSES = (
    "wall", "building", "sky", "floor", "tree", "ceiling", "road", "bed", "windowpane", "grass", "cabinet", "sidewalk",
    "person", "earth", "door", "table", "mountain", "plant", "curtain", "chair", "car", "water", "painting", "sofa",
    "shelf", "house", "sea", "mirror", "rug", "field", "armchair", "seat", "fence", "desk", "rock", "wardrobe", "lamp",
    "bathtub", "railing", "cushion", "base", "box", "column", "signboard", "chest of drawers", "counter", "sand",
    "sink", "skyscraper", "fireplace", "refrigerator", "grandstand", "path", "stairs", "runway", "case", "pool table",
    "pillow", "screen door", "stairway", "river", "bridge", "bookcase", "blind", "coffee table", "toilet", "flower",
    "book", "hill", "bench", "countertop", "stove", "palm", "kitchen island", "computer", "swivel chair", "boat",
    "bar", "arcade machine", "hovel", "bus", "towel", "light", "truck", "tower", "chandelier", "awning",
    "streetlight", "booth", "television receiver", "airplane", "dirt track", "apparel", "pole", "land", "bannister",
    "escalator", "ottoman", "bottle", "buffet", "poster", "stage", "van", "ship", "fountain", "conveyer belt",
    "canopy", "washer", "plaything", "swimming pool", "stool", "barrel", "basket", "waterfall", "tent", "bag",
    "minibike", "cradle", "oven", "ball", "food", "step", "tank", "trade name", "microwave", "pot", "animal",
    "bicycle", "lake", "dishwasher", "screen", "blanket", "sculpture", "hood", "sconce", "vase", "traffic light",
    "tray", "ashcan", "fan", "pier", "crt screen", "plate", "monitor", "bulletin board", "shower", "radiator",
    "glass", "clock", "flag")
