"""The engine under the API: submit, resume, cancel, status, sweeps, reconciliation, failure
explanation. Typed inputs; it reads the registry, asks the schedulers, reads run directories."""
