"""The periodic parts of every run, each a ``Part`` with its own cadence and state: the log point,
the evaluator, the checkpointer, early stopping and the stop check (preemption). A new periodic duty
is a new file here (or anywhere, registered with ``loop.assembly.register_part``)."""
