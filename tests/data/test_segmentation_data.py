"""Semantic segmentation data: the segmentation folder and VOC's SegmentationClass read as their
files say (palette PNGs as indices, VOC's 255 border, MMSeg's reduce_zero_label), bad label maps
under data.on_bad_annotation with one line naming the file and the value, fashion-mosaic's label maps
painted from its instance masks, and label maps that stay on their pixels through the recipe's
transforms."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as T
from PIL import Image
from torchvision import tv_tensors

from segmentation_trees import (FOLDER_CLASSES, GREY, interior, rgb_of, scene, write_segmentation_folder,
                               write_voc_segmentation)
from visiontrain.core import config as C
from visiontrain.data.detection.images import BadAnnotationError
from visiontrain.data.segmentation.readers import VOC_CLASSES, build_semantic_splits
from visiontrain.data.segmentation.transforms import CategoryBalancedCrop
from visiontrain.tasks.semantic import SemanticTask


def splits(*overrides: str):
    return build_semantic_splits(C.load_config("segment-semantic", list(overrides)).data)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_segmentation_folder(tmp_path_factory.mktemp("seg") / "folder")


def test_a_segmentation_folder_gives_each_image_its_label_map_and_classes_txt_its_names(folder):
    train, val = splits("data.name=segmentation-folder", f"data.root={folder}")
    assert (len(train), len(val)) == (6, 3) and train.class_names == list(FOLDER_CLASSES)
    for i in range(len(train)):
        image, labels = train.load(i)
        assert type(labels).__name__ == "Mask" and labels.dtype == torch.uint8
        assert np.array_equal(labels.numpy(), scene(i)) and np.array_equal(image.permute(1, 2, 0).numpy(),
                                                                          rgb_of(scene(i)))


def test_reduce_zero_label_makes_0_the_ignore_index_and_shifts_the_rest(folder):
    train, _ = splits("data.name=segmentation-folder", f"data.root={folder}", "data.reduce_zero_label=true",
                      "data.class_names=[square,bar]")
    assert train.class_names == ["square", "bar"]
    labels = train.load(0)[1].numpy()
    assert np.array_equal(labels, np.array([255, 0, 1], np.uint8)[scene(0)])


def test_voc_reads_its_palette_pngs_as_indices_with_the_border_ignored(tmp_path):
    root = write_voc_segmentation(tmp_path / "VOC2012")
    assert Image.open(root / "SegmentationClass" / "2007_train_000.png").mode == "P"
    train, val = splits("data.name=voc-segmentation", f"data.root={root}")
    assert (len(train), len(val)) == (4, 2) and train.class_names == list(VOC_CLASSES) and len(VOC_CLASSES) == 21
    labels = train.load(0)[1].numpy()
    assert set(np.unique(labels)) == {0, 1, 15, 255}
    inside = scene(0) == 1
    assert (labels[inside] == 1).mean() > 0.7 and set(np.unique(labels[inside])) == {1, 255}  # the edge is 255


def bad_folder(root: Path, fault: str) -> tuple[Path, str]:
    """A folder whose train_1 label map has ``fault``; returns it and that file."""
    write_segmentation_folder(root, {"train": 4, "val": 2})
    label = root / "labels" / "train" / "train_1.png"
    if fault == "size":
        Image.fromarray(scene(1)[:, :50], mode="L").save(label)
    elif fault == "value":
        broken = scene(1).copy()
        broken[0, 0] = 7
        Image.fromarray(broken, mode="L").save(label)
    elif fault == "colour":
        Image.fromarray(rgb_of(scene(1))).save(label)
    else:
        label.write_bytes(b"not a png")
    return root, str(label)


@pytest.mark.parametrize("fault, said", [("size", "is 50x40 (WxH) but its image"), ("value", "value 7 is no class (0..2)"),
                                         ("colour", "is a RGB image"), ("unreadable", "cannot be read")])
def test_a_bad_label_map_is_an_error_naming_it_or_is_skipped_and_counted(tmp_path, fault, said):
    root, label = bad_folder(tmp_path / fault, fault)
    with pytest.raises(BadAnnotationError) as err:
        splits("data.name=segmentation-folder", f"data.root={root}")
    assert label in str(err.value) and said in str(err.value) and "data.on_bad_annotation=skip" in str(err.value)
    train, _ = splits("data.name=segmentation-folder", f"data.root={root}", "data.on_bad_annotation=skip",
                      "data.max_skipped_share=0.5")
    assert len(train) == 3 and sum(train.policy.skipped.values()) == 1
    assert all("train_1" not in image for image, _ in train.pairs)
    train, _ = splits("data.name=segmentation-folder", f"data.root={root}", "data.on_bad_annotation=skip",
                      "data.max_skipped_share=0.5", "data.limit_train=2")  # the first two usable ones, as detection
    assert [Path(image).stem for image, _ in train.pairs] == ["train_0", "train_2"]


def test_fashion_mosaic_paints_each_items_visible_pixels_with_its_class_plus_one():
    train, _ = splits("data.limit_train=4", "data.limit_val=2")
    assert train.class_names[0] == "background" and len(train.class_names) == 11
    for i in range(4):
        image, labels = train.load(i)
        _, target = train.objects.load(i)
        want = torch.zeros(image.shape[-2:], dtype=torch.uint8)
        for mask, label in zip(target["masks"], target["labels"]):
            assert not (want[mask.bool()] > 0).any()  # visible pixels: no two items share one
            want[mask.bool()] = label + 1
        assert torch.equal(labels.as_subclass(torch.Tensor), want) and (labels > 0).any()


def test_label_maps_stay_on_their_pixels_through_the_recipes_transforms(folder):
    """Each pixel of the images is the grey of its class (``GREY``); after the recipe's random
    resize, crop and flip, wherever the labels name a class 2 px around a pixel the image holds that
    class's grey there (a bilinear resize blends the image's edges only), and wherever the crop
    padded, the labels are the ignore index and the image is 0 before normalisation."""
    cfg = C.load_config("segment-semantic", ["data.name=segmentation-folder", f"data.root={folder}",
                                             "data.normalize_on_device=true", "task.crop=64", "task.train_sizes=[30,90]"])
    task = SemanticTask(cfg)
    train = task.build_data().train
    torch.manual_seed(0)
    for _ in range(3):
        for i in range(len(train)):
            image, labels = train[i]
            image, labels = image.as_subclass(torch.Tensor)[0].long(), labels.as_subclass(torch.Tensor).long()
            assert image.shape == labels.shape == (64, 64)
            labelled = labels != 255
            grey = torch.tensor(GREY)[labels.clamp_max(2)]
            assert (image - grey).abs()[labelled & interior(labels)].max() <= 2
            assert (image[~labelled] == 0).all() and labelled.float().mean() > 0.3


def corner_scene(size: int = 100, square: int = 50) -> tuple[tv_tensors.Image, tv_tensors.Mask]:
    """An image whose labels are background (0) but for a ``square`` of class 1 in its top-left corner
    and an ignored (255) bottom row; its pixels number themselves (channel 0: row * size + column)."""
    labels = torch.zeros(size, size, dtype=torch.uint8)
    labels[:square, :square] = 1
    labels[-1] = 255
    return tv_tensors.Image(torch.arange(3 * size * size).reshape(3, size, size)), tv_tensors.Mask(labels)


def mixed(labels: torch.Tensor, ratio: float = 0.75) -> bool:
    """MMSeg's test: two classes or more among the labelled pixels, none ``ratio`` of them or more."""
    counts = torch.bincount(labels[labels != 255].long())
    counts = counts[counts > 0]
    return len(counts) > 1 and bool(counts.max() < ratio * counts.sum())


def test_task_cat_max_ratio_draws_a_crop_again_while_one_class_fills_it_as_mmseg_does():
    """MMSeg's cat_max_ratio: a crop where one class covers 0.75 or more of the labelled pixels (the
    ignore index not counted) is drawn again, up to 10 times. On this scene 26.5 % of a 40 px crop's
    positions are mixed (counted over all 61 x 61): one draw is mixed about a quarter of the time,
    the best of 11 draws 96.6 % of the time; and each crop is still the image's pixels under its own
    labels."""
    image, labels = corner_scene()
    plain, balanced = CategoryBalancedCrop(40, 255), CategoryBalancedCrop(40, 255, cat_max_ratio=0.75)
    torch.manual_seed(0)
    plain_mixed = sum(mixed(plain(image, labels)[1]) for _ in range(200))
    torch.manual_seed(0)
    crops = [balanced(image, labels) for _ in range(200)]
    assert 30 < plain_mixed < 80 and sum(mixed(crop_labels) for _, crop_labels in crops) > 180
    for crop_image, crop_labels in crops:  # the same crop of both: the pixel index says where it came from
        top, left = divmod(int(crop_image[0, 0, 0]), 100)
        assert torch.equal(crop_labels, labels[top:top + 40, left:left + 40])


def test_task_cat_max_ratio_1_is_torchvisions_random_crop_draw_for_draw_and_padding_counts_for_no_class():
    image, labels = corner_scene(size=30, square=20)  # 400 of the 870 labelled pixels are class 1
    torch.manual_seed(3)
    ours = [CategoryBalancedCrop(24, 255)(image, labels) for _ in range(20)]
    torch.manual_seed(3)
    fill = {tv_tensors.Image: 0, tv_tensors.Mask: 255}
    theirs = [T.RandomCrop(24, pad_if_needed=True, fill=fill)(image, labels) for _ in range(20)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ours, theirs))
    crop = CategoryBalancedCrop(40, 255, cat_max_ratio=0.75)  # larger than the image: padded with 255
    params = crop.make_params([image, labels])
    assert params["needs_pad"] and crop._varied(labels, params)  # the padding (255) is not counted
    assert not crop._varied(torch.zeros(30, 30, dtype=torch.uint8), params)  # one class alone
