"""What one training step runs, and the values it runs with: the step pipeline (``pipeline``),
precision, the device-side metric recorder and its guards, the prefetch to the device, the
evaluation batches (``eval_loop``), schedules and the scalars they drive, parameter groups and the
optimizer, the EMA, the accumulation rules and step clock, and the training data's interface
(``source.TrainSource``). Nothing here reads a value on the host during a step."""
