"""orchestrator: Accelerate training scripts from one machine to many Slurm nodes.

Importing the package imports neither torch nor accelerate (CLI start-up speed).
"""

__version__ = "0.1.0"
