"""What one training step runs: the step pipeline (``pipeline``), precision, the device-side metric
recorder and its guards, the prefetch to the device, the evaluation batches (``eval_loop``), the EMA,
the accumulation rules and step clock, and the training data's interface (``source.TrainSource``).
The values it runs with (schedules, parameter groups) are ``engine.optim``'s. Nothing here reads a
value on the host during a step."""
