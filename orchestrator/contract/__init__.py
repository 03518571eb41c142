"""The contract between the node, the ranks and every reader of a run directory: file names, exit
codes, the environment names passed from node to rank, the rule for a complete checkpoint.

Standard library only: ``train/`` and users' scripts import it on every rank."""
