"""The optimiser's configuration: parameter groups and their rules (``param_groups``), the per-step
schedules as pure functions of the step (``schedules``) and what applies them each step (``scalars``)."""
