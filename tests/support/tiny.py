"""The small sizes the family tests train at: a few seconds a step on one core, each recipe's structure
otherwise. Shared by each family's own tests and by the tests that run every family (host reads,
two ranks, device-side normalisation)."""

# 8x8 digits, a 1-block ViT with 2 px patches: a few seconds per run on one thread. These tests are
# about DINO's loss, teacher, schedules and resume, not the recipe as shipped (test_recipes.py): they
# load in-process (no workers) and in fp32 (exact comparisons).
DINO = ["data.name=digits", "task.patch_size=2", "task.global_crop_size=8", "task.local_crop_size=4",
        "task.backbone_args={embed_dim: 32, depth: 1, num_heads: 2}", "task.out_dim=64", "task.hidden_dim=32",
        "task.bottleneck_dim=16", "task.local_crops=2", "task.knn_bank=null", "task.blur_sigma=[0.1, 0.5]",
        "data.batch_size=32", "data.eval_batch_size=200", "data.num_workers=0", "trainer.progress=plain",
        "trainer.precision=fp32", "trainer.plots=false"]  # no figures (2 s of CPU a run) but in the test of them


# Runs shorter than an epoch take real steps from the start (a warm-up from 0 would barely move them)
DINO_NO_WARMUP = ["schedules.lr.warmup=0", "schedules.task.teacher_temp.warmup=0"]

# Small enough for a few seconds a step on one core; the recipe's structure otherwise. Loaded in-process:
# these tests are about the model, its groups and predict; test_recipes.py runs the recipe's workers.
RCNN = ["task.fpn_channels=32", "task.representation_size=64", "task.train_scales=[128]", "task.val_size=128",
        "task.max_size=192", "task.rpn_batch_size_per_image=64", "task.box_batch_size_per_image=32",
        "task.rpn_pre_nms_top_n=[200,100]", "task.rpn_post_nms_top_n=[100,50]", "data.batch_size=2",
        "data.num_workers=0"]

# YOLO: a 64 x 64 input
YOLO = ["task.backbone=darknet21", "task.backbone_width=0.125", "task.neck_channels=[16,16,8]"]
