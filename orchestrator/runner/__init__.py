"""The operations under the API that reach the registry and the schedulers: submit, resume, cancel,
status and its reconciliation, sweeps, logs, stacks, cost, export, failure reasons. Typed inputs;
each reads the registry, asks the schedulers and reads run directories through
:mod:`orchestrator.rundir`."""
