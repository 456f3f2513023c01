"""What a run keeps, so that a crash at any moment leaves it resumable: atomic files (``files``),
checkpoint I/O whole or sharded (``checkpoint``, ``sharded``, ``dcp_reader``), the weights a run starts
from or ends with (``weights``) and its resume rules (``run_dir``). The checkpoint's schema and the run
dir's names are ``visiontrain.rundir``'s, free of torch."""
