"""What a run keeps, so that a crash at any moment leaves it resumable: the checkpoint's schema and
version (``checkpoint_format``), atomic files (``files``), checkpoint I/O whole or sharded
(``checkpoint``, ``sharded``), the weights a run starts from or ends with (``weights``), the run dir's
file names and its resume rules (``run_files``, ``run_dir``), and the wording of a failed write
(``write_failure``)."""
