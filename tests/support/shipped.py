"""What a test may change in a built-in recipe without saying why: the run's length and size.

A user runs `visiontrain fit RECIPE` with the recipe as written; a test that changes anything else
(workers, their start method, precision, transforms, schedules) tests something a user does not run,
and must say why in a comment (tests/conftest.py). The docs' tested commands may append only these
keys (tests/test_docs.py checks their markers).
"""

LENGTH_AND_SIZE = frozenset({
    "trainer.epochs", "trainer.max_steps",                       # length
    "data.root", "data.limit_train", "data.limit_val",           # which data, how much of it
    "data.batch_size", "data.eval_batch_size", "task.knn_bank",  # batch and evaluation sizes
    "data.image_size", "task.train_scales", "task.max_size", "task.val_size", "task.crop_resize",
    "task.crop_min", "task.crop_max", "task.size", "task.multiscale_sizes", "task.global_crop_size",
    "task.local_crop_size", "task.crop", "task.train_sizes",     # image sizes
})
