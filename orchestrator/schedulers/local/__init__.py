"""Local: simulated nodes as processes on this machine (submitit's LocalExecutor), no Slurm."""
