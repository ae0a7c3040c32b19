"""Measuring what the planner needs: devices, links between them, and per-layer model costs."""
