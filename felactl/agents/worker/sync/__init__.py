"""The sync strategies. Each module's ``run(trainer)`` trains ``cfg.steps`` iterations' worth of samples."""
