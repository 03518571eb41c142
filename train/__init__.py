"""Reference training program for the orchestrator (see train/train.py)."""
