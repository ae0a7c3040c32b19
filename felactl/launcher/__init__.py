"""The job: the control plane, starting agents, run directories, launch and status."""
