"""The job registry: SQLite storage only (schema and migrations, jobs, runs, attempts, sweeps,
submissions). It asks no scheduler and reads no run directory."""
