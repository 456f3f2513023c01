"""The loop: ``trainer.Trainer.fit`` runs the built run step by step and asks its parts after each
step; ``assembly`` makes the run's ordered list of parts and hooks and registers their states."""
