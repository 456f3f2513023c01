"""Reading runs for people, without torch: ``compare`` (runs side by side) and ``page`` (one
self-contained HTML report of a run)."""
