"""What reads a run directory: summaries, metric series, a run's details, liveness, log following,
plots, the resume lock, and ``export/``. No registry, no scheduler: given a run directory, these
answer from its files alone (the contract's layout)."""
