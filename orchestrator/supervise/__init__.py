"""What watches a running allocation: the hang watchdog, the preflight and rank stacks. It reaches
the job's nodes through the scheduler's methods, never by naming a scheduler's command."""
