"""The data-parallel sync strategies (one class each; the table of them is felactl.agents.worker.strategies)."""
