"""Slurm: the request (sbatch through submitit), job arrays, the squeue/sacct query and state
tables, the node environment (``SLURM_*``), the batch step's supervision, requeue and continue."""
