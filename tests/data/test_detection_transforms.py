"""Box-aware transforms (hand-computed boxes), the padded collate with its mask, and the
aspect-ratio grouped sampler (groups, counts, exact resume, disjoint shards)."""
from __future__ import annotations

import pytest
import torch
from torchvision import tv_tensors
import torchvision.transforms.v2 as T

from visiontrain.data.detection.transforms import (RandomSizeCrop, collate_detection, detr_train_transform,
                                                   detr_val_transform, normalized_cxcywh)
from visiontrain.data.samplers import GroupedBatchSampler, sample_seed


def sample(h: int, w: int, boxes: list[list[float]], labels: list[int] | None = None):
    image = tv_tensors.Image(torch.randint(0, 255, (3, h, w), dtype=torch.uint8))
    target = {"boxes": tv_tensors.BoundingBoxes(torch.tensor(boxes, dtype=torch.float32), format="XYXY",
                                                canvas_size=(h, w)),
              "labels": torch.tensor(labels if labels is not None else list(range(len(boxes)))),
              "image_id": 1, "orig_size": torch.tensor([h, w])}
    return image, target


def test_flip_moves_boxes():
    image, target = sample(50, 100, [[10, 5, 30, 25]])
    out_img, out = T.RandomHorizontalFlip(p=1.0)(image, target)
    assert out["boxes"].tolist() == [[70, 5, 90, 25]]  # x -> 100 - x
    assert torch.equal(out_img, image.flip(-1))


def test_shortest_side_resize_scales_boxes():
    image, target = sample(50, 100, [[10, 5, 30, 25]])
    out_img, out = T.RandomShortestSize([100], max_size=1000)(image, target)
    assert out_img.shape[-2:] == (100, 200)
    assert out["boxes"].tolist() == [[20, 10, 60, 50]]
    _, out = T.RandomShortestSize([100], max_size=150)(image, target)  # the longer side caps it
    assert out["boxes"].canvas_size == (75, 150)
    assert out["boxes"][0].tolist() == pytest.approx([15, 7.5, 45, 37.5])


def test_random_size_crop_shifts_and_clips_boxes_and_sanitize_drops_emptied():
    image, target = sample(100, 100, [[0, 0, 100, 100], [0, 0, 4, 4], [96, 96, 100, 100]], [0, 1, 2])
    torch.manual_seed(0)
    crop = RandomSizeCrop(50, 50)
    params = crop.make_params([image])
    torch.manual_seed(0)
    out_img, out = T.Compose([crop, T.SanitizeBoundingBoxes(labels_getter=lambda s: s[1]["labels"])])(image, target)
    top, left = params["top"], params["left"]
    assert out_img.shape[-2:] == (50, 50)
    assert torch.equal(out_img, image[:, top:top + 50, left:left + 50])
    assert out["boxes"][0].tolist() == [0, 0, 50, 50]  # the full-image box, clipped to the crop
    expected_labels = [0] + [1] * (top < 4 and left < 4) + [2] * (top + 50 > 96 and left + 50 > 96)
    assert out["labels"].tolist() == expected_labels  # boxes the crop emptied went with their labels


def test_train_and_val_pipelines_give_normalised_float_images_with_boxes():
    image, target = sample(120, 200, [[20, 30, 60, 90]])
    torch.manual_seed(1)
    img, out = detr_train_transform([96, 128], 200, [100], 64, 96)(image, target)
    assert img.dtype == torch.float32 and img.shape[0] == 3
    assert out["boxes"].canvas_size == tuple(img.shape[-2:])
    img, out = detr_val_transform(96, 200)(image, target)
    assert img.shape[-2:] == (96, 160)
    assert out["boxes"][0].tolist() == pytest.approx([16, 24, 48, 72])
    assert abs(img.mean().item()) < 3  # normalised with ImageNet statistics


def test_normalized_cxcywh():
    boxes = torch.tensor([[50.0, 25.0, 150.0, 75.0]])
    assert normalized_cxcywh(boxes, 100, 200).tolist() == [[0.5, 0.5, 0.5, 0.5]]


def test_collate_pads_with_mask():
    a = (tv_tensors.Image(torch.ones(3, 40, 60)), {"boxes": torch.zeros(1, 4), "labels": torch.tensor([1]),
                                                   "image_id": 7, "orig_size": torch.tensor([40, 60])})
    b = (tv_tensors.Image(2 * torch.ones(3, 50, 30)), {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0),
                                                       "image_id": 8, "orig_size": torch.tensor([50, 30])})
    images, mask, targets = collate_detection([a, b])
    assert images.shape == (2, 3, 64, 64) and mask.shape == (2, 64, 64)
    assert images[0, :, :40, :60].eq(1).all() and images[0, :, 40:].eq(0).all() and images[0, :, :, 60:].eq(0).all()
    assert (~mask[0]).sum() == 40 * 60 and (~mask[1]).sum() == 50 * 30
    assert not mask[1, :50, :30].any() and mask[1, 50:].all()
    assert [t["image_id"] for t in targets] == [7, 8]
    assert targets[1]["size"].tolist() == [50, 30] and targets[1]["boxes"].shape == (0, 4)


def test_grouped_sampler_groups_counts_resume_and_shards():
    groups = [0] * 37 + [1] * 23
    s = GroupedBatchSampler(groups, 4, seed=3, seeded=False)
    assert s.batches_per_epoch == 37 // 4 + 23 // 4 == 14
    s.set_epoch(2)
    full = list(s)
    assert len(full) == 14 and all(len({groups[i] for i in b}) == 1 for b in full)
    assert len({i for b in full for i in b}) == 56  # no sample twice
    s.set_epoch(2, start_batch=5)
    assert list(s) == full[5:]  # resume mid-epoch: the same batches from batch 5 on
    s.set_epoch(3)
    assert list(s) != full  # another epoch, another order
    r0 = GroupedBatchSampler(groups, 4, seed=3, rank=0, world_size=2, seeded=False)
    r1 = GroupedBatchSampler(groups, 4, seed=3, rank=1, world_size=2, seeded=False)
    b0, b1 = list(r0), list(r1)
    assert len(b0) == len(b1) == 7
    assert not {i for b in b0 for i in b} & {i for b in b1 for i in b}
    seeded = GroupedBatchSampler(groups, 4, seed=3)
    first = next(iter(seeded))
    assert [s for _, s in first] == [sample_seed(3, 0, i) for i, _ in first]  # each sample's own seed
