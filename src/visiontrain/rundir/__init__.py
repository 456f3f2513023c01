"""What a run directory holds, without torch: its file and folder names, the metrics file's rows, the
checkpoint's schema and version, the one-writer lock and how a failed write is named. ``compare``,
``report`` and ``tune`` read a run through these alone; the engine writes through them."""
